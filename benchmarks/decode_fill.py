"""The host's cost of staging a decode step's buffers (`engine/decode_batch.DecodeBatch.fill`), with
block tables staged as they grow against every table staged whole (as before 2026-12-03), side by
side in one run:

    python3 benchmarks/decode_fill.py [--rows 16,61,128,250] [--reps 2000]

Each sequence has a random context of 300-1,900 tokens (block 16; gpu_serving's prompts). Steps:
"steady" feeds the same sequences in the same rows; "one moves" drops the first sequence every other
step, so every row moves up one (a sequence finishing at the top of the batch, the worst case).
CPU only: the device copies are host-to-host here, so the figures are the Python and numpy work.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb  # noqa: E402,F401  (maps kvmesh to shared/ when needed)

from kvmesh.engine.decode_batch import DecodeBatch, DecodeShape  # noqa: E402
from kvmesh.kernels.metadata import SeqSlice  # noqa: E402

BS = 16


def fill_us(batch: DecodeBatch, steps, reps: int, whole: bool) -> float:
    """Median over 3 rounds of µs a `fill`; `whole`: the staged tables forgotten before each."""
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        for k in range(reps):
            if whole:
                batch._staged = {}
            batch.fill(*steps(k))
        rounds.append((time.perf_counter() - t0) / reps * 1e6)
    return sorted(rounds)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,61,128,250")
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    print("| rows | steps | tables whole us | as they grow us | whole / grown |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in a.rows.split(",")):
        n = next(s for s in (16, 64, 128, 256) if s >= rows + 1)
        shape = DecodeShape(rows=n, table_width=2048 // BS + 1, block_size=BS, num_slots=n + 2,
                            scratch_slot=n + 1, work_units=n + 132)
        rng = np.random.default_rng(rows)
        seqs = [SeqSlice(int(L), 1, [int(v) for v in rng.integers(0, 4000, int(L) // BS + 1)], i)
                for i, L in enumerate(rng.integers(300, 1900, rows + 1))]
        tokens = list(range(rows))
        for name, steps in (("steady", lambda k: (tokens, seqs[:rows])),
                            ("one moves", lambda k: (tokens, seqs[k % 2:rows + k % 2]))):
            batch = DecodeBatch(shape, torch.device("cpu"))
            whole = fill_us(batch, steps, a.reps, True)
            grown = fill_us(batch, steps, a.reps, False)
            print(f"| {rows} | {name} | {whole:.1f} | {grown:.1f} | {whole / grown:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
