"""The decode kernel's time by split count at one head shape (H200), beside the engine's own choice:
`kernels.py`'s data and timing (CUDA graph of 10 calls, median) at other heads and cases.

    python3 benchmarks/decode_splits.py --q-heads 9 --kv-heads 3 --head-dim 64 \\
        --cases 72x1024,72x2048,32x1024,128x1024 --dtypes int4 --splits 1,2,3,4,5,6,8,12

Each split count runs with the reduction the launcher picks (fused up to FUSED_MAX_SPLITS, else a
second launch) and, past that, fused as well ("fused"). Every sequence has the case's context.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb  # noqa: E402  (maps kvmesh to shared/ when needed; cases, data and timing)

from kvmesh.kernels.decode_attention import decode_attention  # noqa: E402
from kvmesh.kernels.decode_direct import decode_direct  # noqa: E402
from kvmesh.kernels.decode_int4_direct import decode_int4_direct  # noqa: E402
from kvmesh.kernels.split_partials import FUSED_MAX_SPLITS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cases", default="72x1024,72x2048,32x1024,128x1024", help="BATCHxCONTEXT,...")
    ap.add_argument("--dtypes", default="int4")
    ap.add_argument("--splits", default="1,2,3,4,5,6,8,12")
    a = ap.parse_args()
    kb.H, kb.KVH, kb.D = a.q_heads, a.kv_heads, a.head_dim  # module globals of kernels.py
    kb.DECODE_CASES = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
    counts = [int(s) for s in a.splits.split(",")]
    print(f"H {a.q_heads}, KVH {a.kv_heads}, D {a.head_dim}")
    print("| case | kv | kernel | us | x SDPA |\n|---|---|---|---|---|")
    for case, t_sdpa, kv, (cache, meta, q, kn, vn) in kb.decode_problems(a.dtypes.split(","), a.reps):
        scale = a.head_dim ** -0.5
        direct = decode_int4_direct if kv == "int4" else decode_direct
        runs = [("engine", lambda: decode_attention(cache, 0, q, kn, vn, meta, scale))]
        for s in counts:
            runs.append((f"splits={s}", lambda s=s: direct(cache, 0, q, kn, vn, meta, scale, splits=s)))
            if s > FUSED_MAX_SPLITS:
                runs.append((f"splits={s} fused",
                             lambda s=s: direct(cache, 0, q, kn, vn, meta, scale, splits=s, fused=True)))
        for name, fn in runs:
            t = kb.time_ms(fn, a.reps)
            print(f"| {case} | {kv} | {name} | {t * 1e3:.1f} | {t_sdpa / t:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
