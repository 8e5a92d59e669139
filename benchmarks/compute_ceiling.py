"""What bounds a decode kernel: its time over the real cache beside the same launch whose block tables
point into a few hot pages (every byte then comes from L2, or L1). If the hot runs are much faster,
the pages' trip from DRAM is what the kernel waits on; if they are not, its own instructions are.

    python3 benchmarks/compute_ceiling.py [--reps 20] [--dtypes int4,fp8_e4m3,int8,fp16]

Same cases, data and timing as `kernels.py` (CUDA graph of 10 calls, median); the hot tables keep each
sequence's length and split count, only the page ids change: "L2" scatters every sequence over the
pool's first 256 pages (a layer's: ~5 MB of INT4 pages, ~8 MB of fp8, 16 MB of fp16: inside the
H200's 50 MB L2), "L1" points every entry at page 0."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb  # noqa: E402  (maps kvmesh to shared/ when needed; cases, data and timing)

from kvmesh.kernels.decode_attention import decode_attention  # noqa: E402


def hot_tables(meta, n_hot: int):
    """meta with block tables whose every entry is one of the pool's pages 0 .. n_hot - 1, scattered."""
    bt = meta.block_tables
    b = torch.arange(bt.shape[0], device=bt.device, dtype=bt.dtype)[:, None]
    c = torch.arange(bt.shape[1], device=bt.device, dtype=bt.dtype)[None, :]
    hot = torch.where(bt >= 0, (7 * b + 13 * c) % n_hot, bt)
    return dataclasses.replace(meta, block_tables=hot.contiguous())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtypes", default="int4,fp8_e4m3,int8,fp16")
    a = ap.parse_args()
    rows = []
    for batch, ctx in kb.DECODE_CASES:
        case = kb.decode_case(batch, ctx)
        t_sdpa, _ = kb.time_sdpa(case, a.reps)
        for kv in a.dtypes.split(","):
            cache, meta, q, kn, vn = kb.decode_problem(kv, case)
            scale = kb.D ** -0.5
            times = {}
            for name, m in (("DRAM", meta), ("L2", hot_tables(meta, 256)),
                            ("L1", hot_tables(meta, 1))):
                times[name] = kb.time_ms(lambda: decode_attention(cache, 0, q, kn, vn, m, scale), a.reps)
            rows.append((f"{batch}x{ctx}", kv, t_sdpa, times))
            kb.log(f"  {batch}x{ctx} {kv}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in times.items()))
            torch.cuda.empty_cache()
    print("\n| case | kv | SDPA us | pages from DRAM us (x SDPA) | from L2 us (x SDPA) | from L1 us (x SDPA) |")
    print("|---|---|---|---|---|---|")
    for case, kv, t_sdpa, t in rows:
        print(f"| {case} | {kv} | {t_sdpa * 1e3:.1f} | " + " | ".join(
            f"{t[k] * 1e3:.1f} ({t_sdpa / t[k]:.2f}x)" for k in ("DRAM", "L2", "L1")) + " |")


if __name__ == "__main__":
    main()
