"""What a wave of one-warp programs costs before any page, on the GPU, in one run:

    python3 benchmarks/wave_cost.py

1. A plain Triton kernel per grid (programs x warps) chasing 0/1/3/6 dependent random 4-byte loads
   through 256 MB (microseconds a launch: the floor a wave of short programs stands on).
2. The 8-bit direct kernel's one wave (16 programs an SM, one split each) at growing contexts, the
   residual tail read first or last (its fixed cost and streaming rate; INT4's:
   `int4_direct_check.py --context-sweep`). Same timing as kernels.py. Results: docs/decode_direct.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels as kb  # benchmarks/kernels.py: timing (CUDA graphs, events, median), kvmesh on the path
from kvmesh.kernels.decode_direct import decode_direct  # noqa: E402


@triton.jit
def chase(idx_ptr, out_ptr, N_HOPS: tl.constexpr, BLOCK: tl.constexpr):
    """Each program: N_HOPS dependent loads i = idx[i] from its own start, then one store of BLOCK values."""
    pid = tl.program_id(0)
    i = pid * 7919
    for _ in tl.static_range(N_HOPS):
        i = tl.load(idx_ptr + i)
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + pid * BLOCK + offs, i + offs)


def chase_table(reps: int) -> None:
    idx = torch.randperm(1 << 26, device="cuda", dtype=torch.int64).to(torch.int32)  # 256 MB of int32
    out = torch.empty(1 << 22, device="cuda", dtype=torch.int32)
    print("| programs x warps | 0 hops | 1 | 3 | 6 |\n|---|---|---|---|---|")
    for progs, warps in ((1584, 1), (2112, 1), (396, 4), (132, 1), (1, 1)):
        cells = []
        for hops in (0, 1, 3, 6):
            t = kb.time_ms(lambda: chase[(progs,)](idx, out, N_HOPS=hops, BLOCK=32 * warps, num_warps=warps), reps)
            cells.append(f"{t * 1000:.2f}")
        print(f"| {progs} x {warps} | " + " | ".join(cells) + " | (us)", flush=True)


def direct_wave(reps: int, kv: str) -> None:
    """One wave of the 8-bit direct kernel (16 programs an SM, one split each) at growing contexts."""
    batch = torch.cuda.get_device_properties(0).multi_processor_count * 16 // kb.KVH
    print(f"\n{kv}, {batch} x {kb.KVH} programs:\n| context | tail first us | tail last us |\n|---|---|---|")
    for ctx in (16, 256, 1024, 2048, 4096):
        cache, meta, q, kn, vn = kb.decode_problem(kv, kb.decode_case(batch, ctx))
        cells = []
        for first in (True, False):
            t = kb.time_ms(lambda: decode_direct(cache, 0, q, kn, vn, meta, kb.D ** -0.5, splits=1,
                                                 tail_first=first), reps)
            cells.append(f"{t * 1000:.1f}")
        print(f"| {ctx} | " + " | ".join(cells) + " |", flush=True)
        del cache
        torch.cuda.empty_cache()


def main() -> None:
    torch.set_grad_enabled(False)
    chase_table(20)
    for kv in ("fp8_e4m3", "int8"):
        direct_wave(20, kv)


if __name__ == "__main__":
    main()
