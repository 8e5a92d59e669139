"""The second-launch split reduction alone (`reduce_splits_kernel`) on the H200, over the partials
of ragged batches' work lists and of uniform batches: every tile choice (heads a program, splits a
step, warps, pipeline stages) against the launcher's own (`splits.REDUCE_HEADS`, `REDUCE_SPLITS`), timed as
benchmarks/kernels.py times (CUDA graph of 10 calls, median of replays). Prints one table of µs,
the launcher's choice first.

    python3 benchmarks/split_reduce.py [--reps 20]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]
import kernels as kb  # noqa: E402  (maps kvmesh to shared/ when needed; the timing method)

from kvmesh.kernels.partials import reduce_splits_kernel  # noqa: E402
from kvmesh.kernels.splits import REDUCE_HEADS, REDUCE_SPLITS  # noqa: E402
from kvmesh.kernels.work_list import BatchContexts  # noqa: E402

H, D = 32, 128
# (name, batch, splits of the longest, contexts or None for a uniform batch)
SHAPES = [("64: 32K + 63 x 1K @75", 64, 75, [32769] + [1025] * 63),
          ("64: 32K + 63 x 1K @128", 64, 128, [32769] + [1025] * 63),
          ("128: 16K + 127 x 512 @31", 128, 31, [16385] + [513] * 127),
          ("32: 128K + 31 x 2K @128", 32, 128, [131073] + [2049] * 31),
          ("uniform 16 @16", 16, 16, None),
          ("uniform 8 @33", 8, 33, None)]
VARIANTS = list(itertools.product((1, 4), (8, 16, 32, 64), (4, 8), (1, 3)))  # hb, sb, warps, stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    print("| partials | launcher's (hb, sb) | its µs | best: hb, sb, warps, stages | best µs |\n|---|---|---|---|---|")
    for name, batch, splits, lens in SHAPES:
        plan = BatchContexts.of(lens).plan(splits, dev) if lens else None
        rows = (plan.units, H) if plan else (batch, H, splits)
        part = torch.randn(*rows, D, device=dev)
        lse = torch.randn(*rows, device=dev)
        out = torch.empty(batch, H, D, dtype=torch.float16, device=dev)
        units = plan.seq_units if plan else torch.zeros(batch, dtype=torch.int32, device=dev)

        def run(hb, sb, warps, stages):
            return lambda: reduce_splits_kernel[(batch, -(-H // hb))](
                part, lse, out, out.stride(0), out.stride(1), units, H=H, SPLITS=splits, D=D, HB=hb, SB=sb,
                WORK=plan is not None, num_warps=warps, num_stages=stages)
        hb, sb = REDUCE_HEADS, REDUCE_SPLITS
        own = kb.time_ms(run(hb, sb, 4, 3), a.reps) * 1000
        times = {v: kb.time_ms(run(*v), a.reps) * 1000 for v in VARIANTS if v[0] * v[1] <= 128}
        best = min(times, key=times.get)
        print(f"| {name} | {hb}, {sb} | {own:.1f} | {best} | {times[best]:.1f} |", flush=True)
        print("    " + ", ".join(f"{v}: {t:.1f}" for v, t in sorted(times.items(), key=lambda x: x[1])[:8]), flush=True)


if __name__ == "__main__":
    main()
