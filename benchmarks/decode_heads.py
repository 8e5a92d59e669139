"""Decode attention at other head shapes than `kernels.py`'s Llama-3-8B (32 query, 8 KV heads): SDPA
over contiguous fp16 K/V beside the engine's path and the plain Triton kernel for each KV dtype, same
cases, data and timing as `kernels.py` (CUDA graph of 10 calls, median).

    python3 benchmarks/decode_heads.py --q-heads 64 --kv-heads 4      # G 16 (Qwen3-235B-A22B's heads)
    python3 benchmarks/decode_heads.py --q-heads 64 --kv-heads 4 --variants "maxnreg=168"
    python3 benchmarks/decode_heads.py --q-heads 64 --kv-heads 4 --dtypes int4   # + the INT4 direct kernel

--variants times `decode_direct` with those keyword arguments beside the engine's path (8-bit pages); for
int4 pages the direct kernel is timed beside the engine's path (the same kernel up to G `ROUTED_GROUP`,
the tile kernel past it)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb  # noqa: E402  (maps kvmesh to shared/ when needed; cases, data and timing)

from kvmesh.kernels.decode_attention import decode_attention  # noqa: E402
from kvmesh.kernels.decode_direct import decode_direct  # noqa: E402
from kvmesh.kernels.decode_int4_direct import decode_int4_direct  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--q-heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtypes", default="fp8_e4m3,int8")
    ap.add_argument("--variants", default="", help="';'-separated k=v[,k=v] keyword sets for decode_direct")
    a = ap.parse_args()
    kb.H, kb.KVH, kb.D = a.q_heads, a.kv_heads, a.head_dim  # the cases' shapes (module globals of kernels.py)
    variants = [{k: int(v) for k, v in (o.split("=") for o in spec.split(","))} for spec in a.variants.split(";")
                if spec]
    rows = []
    for case, t_sdpa, kv, (cache, meta, q, kn, vn) in kb.decode_problems(a.dtypes.split(","), a.reps):
        scale = a.head_dim ** -0.5
        runs = [("engine", lambda: decode_attention(cache, 0, q, kn, vn, meta, scale)),
                ("plain", lambda: decode_attention(cache, 0, q, kn, vn, meta, scale, direct=False))]
        if kv == "int4":  # the direct kernel even where the engine does not send it (G > ROUTED_GROUP)
            runs += [("int4 direct", lambda: decode_int4_direct(cache, 0, q, kn, vn, meta, scale))]
        else:
            runs += [(",".join(f"{k}={v}" for k, v in kw.items()),
                      lambda kw=kw: decode_direct(cache, 0, q, kn, vn, meta, scale, **kw)) for kw in variants]
        for name, fn in runs:
            t = kb.time_ms(fn, a.reps)
            rows.append((case, kv, name, t, t_sdpa / t))
            kb.log(f"  {case} {kv} {name}: {t * 1e3:.1f} us  {t_sdpa / t:.2f}x sdpa")
    print(f"\nH {a.q_heads}, KVH {a.kv_heads}, D {a.head_dim}\n| case | kv | kernel | us | x SDPA |\n|---|---|---|---|---|")
    for case, kv, name, t, x in rows:
        print(f"| {case} | {kv} | {name} | {t * 1e3:.1f} | {x:.2f}x |")


if __name__ == "__main__":
    main()
