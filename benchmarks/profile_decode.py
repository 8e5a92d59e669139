"""One decode case launched plainly (no CUDA graph) a few times, for Nsight Compute to profile one launch:

    ncu --clock-control none --kernel-name regex:direct --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 benchmarks/profile_decode.py --kv int4 --case 64x4096

The case, data and page order are `kernels.py`'s (Llama-3-8B heads, block 16, pages in random order);
the call is the engine's (`decode_attention`, which picks the kernel and its split count), or with
`--int4-kw "l2_prefetch=0,..."` the INT4 direct kernel's with those integer keyword arguments. Prints
the median time of the plain launches too, host launch cost included (ncu's duration is the kernel's)."""
from __future__ import annotations

import argparse
import statistics

import torch

import kernels as kb  # benchmarks/kernels.py (puts kvmesh on the path too)
from kvmesh.kernels.decode_attention import decode_attention
from kvmesh.kernels.decode_int4_direct import decode_int4_direct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="int4", help="KV dtype of the pages (fp16, bf16, fp8_e4m3, int8, int4, ...)")
    ap.add_argument("--case", default="64x4096", help="batch x context")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--int4-kw", default="", help="k=v,...: call decode_int4_direct with these integer arguments")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    batch, ctx = (int(x) for x in a.case.split("x"))
    cache, meta, q, kn, vn = kb.decode_problem(a.kv, kb.decode_case(batch, ctx))
    scale = kb.D ** -0.5
    kw = {k: int(v) for k, v in (o.split("=") for o in a.int4_kw.split(",") if o)}
    call = (lambda: decode_int4_direct(cache, 0, q, kn, vn, meta, scale, **kw)) if a.int4_kw else (
        lambda: decode_attention(cache, 0, q, kn, vn, meta, scale))
    times = []
    for _ in range(a.launches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    print(f"{a.kv} {a.case} {a.int4_kw}: {a.launches} plain launches, median {statistics.median(times):.1f} us")


if __name__ == "__main__":
    main()
