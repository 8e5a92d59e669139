"""What bounds a decode kernel: its time over the real cache beside the same launch whose block tables
point into a few hot pages (every byte then comes from L2, or L1). If the hot runs are much faster,
the pages' trip from DRAM is what the kernel waits on; if they are not, its own instructions are.

    python3 benchmarks/compute_ceiling.py [--reps 20] [--dtypes int4,fp8_e4m3,int8,fp16]
    python3 benchmarks/compute_ceiling.py --dtypes int4 --int4 "tail_last;mod_vinp:tail_first=0"

--int4 times the INT4 kernel's variants instead of the engine's path, named as `int4_direct_check.py`
names them (its VARIANTS, or mod_<name>[:k=v] for a git-ignored copy kernels/_<name>_int4_direct.py).

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
from int4_direct_check import variant  # noqa: E402  (INT4 variants by name)

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
    ap.add_argument("--int4", default="", help="INT4 kernel variants to time instead of the engine's path")
    a = ap.parse_args()
    int4 = [(v, *variant(v)) for v in a.int4.split(";") if v]
    rows = []
    for label_case, t_sdpa, kv, (cache, meta, q, kn, vn) in kb.decode_problems(a.dtypes.split(","), a.reps):
        scale = kb.D ** -0.5
        runs = [(label, fn, kw) for label, fn, kw in int4] if kv == "int4" and int4 else [(kv, decode_attention, {})]
        for label, fn, kw in runs:
            times = {}
            for name, m in (("DRAM", meta), ("L2", hot_tables(meta, 256)), ("L1", hot_tables(meta, 1))):
                times[name] = kb.time_ms(lambda: fn(cache, 0, q, kn, vn, m, scale, **kw), a.reps)
            rows.append((label_case, label, t_sdpa, times))
            kb.log(f"  {label_case} {label}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in times.items()))
    print("\n| case | kv | SDPA us | pages from DRAM us (x SDPA) | from L2 us (x SDPA) | from L1 us (x SDPA) |")
    print("|---|---|---|---|---|---|")
    for case, kv, t_sdpa, t in rows:
        print(f"| {case} | {kv} | {t_sdpa * 1e3:.1f} | " + " | ".join(
            f"{t[k] * 1e3:.1f} ({t_sdpa / t[k]:.2f}x)" for k in ("DRAM", "L2", "L1")) + " |")


if __name__ == "__main__":
    main()
