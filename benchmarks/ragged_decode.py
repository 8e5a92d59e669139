"""Decode over ragged batches (one long sequence among short ones) on the H200: the launcher's split
count for the batch as it is (`splits.num_splits(..., total_context)`: the long sequence's splits set
the time) against the count a batch all at the longest context would take (the metadata without its
context sum), each KV dtype on the engine's path, timed as benchmarks/kernels.py times (CUDA graph of
10 calls, median of replays). Prints one table of the two times and their ratio.

    python3 benchmarks/ragged_decode.py [--reps 20] [--dtypes fp16,fp8_e4m3,int8,int4]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
import kernels as kb  # noqa: E402  (maps kvmesh to shared/ when needed; the timing method)

from kvmesh.kernels.decode_attention import decode_attention  # noqa: E402
from kvmesh.kernels.splits import num_sms, num_splits  # noqa: E402

# (batch, the long sequence's context, every other sequence's context)
CASES = [(64, 32768, 1024), (128, 16384, 512), (32, 131072, 2048), (8, 32768, 4096)]
GQA, D, BS, KVH = 4, 128, 16, 8


def time_case(kv: str, batch: int, long: int, short: int, reps: int) -> tuple[float, float, float]:
    """(ms with the ragged count, ms with the uniform count, rel. L2 between their outputs)."""
    from test_kernels_attention import make_case

    dt = torch.bfloat16 if kv == "bf16" else torch.float16
    lens = [long] + [short] * (batch - 1)
    cache, meta, q, k, v = make_case(kv, GQA, D, BS, lens, [1] * batch, kv_heads=KVH, num_layers=1, layer=0,
                                     device="cuda", seed=batch, model_dtype=dt)
    uniform = dataclasses.replace(meta, sum_prefix_len=0)  # as if every sequence were the longest
    scale = D ** -0.5
    a = decode_attention(cache, 0, q, k, v, meta, scale).float()
    b = decode_attention(cache, 0, q, k, v, uniform, scale).float()
    err = ((a - b).norm() / b.norm()).item()
    t_new = kb.time_ms(lambda: decode_attention(cache, 0, q, k, v, meta, scale), reps)
    t_old = kb.time_ms(lambda: decode_attention(cache, 0, q, k, v, uniform, scale), reps)
    return t_new, t_old, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtypes", default="fp16,fp8_e4m3,int8,int4")
    a = ap.parse_args()
    sms = num_sms(torch.device("cuda"))
    print("| batch: long + short contexts | kv | splits (uniform: 16 a SM) | ms uniform count | ms ragged count "
          "| speedup | rel. L2 |\n|---|---|---|---|---|---|---|")
    for batch, long, short in CASES:
        total = long + 1 + (batch - 1) * (short + 1)
        counts = (num_splits(batch, KVH, long + 1, sms, 16, BS), num_splits(batch, KVH, long + 1, sms, 16, BS, total))
        for kv in a.dtypes.split(","):
            t_new, t_old, err = time_case(kv, batch, long, short, a.reps)
            print(f"| {batch}: 1 x {long} + {batch - 1} x {short} | {kv} | {counts[0]} -> {counts[1]} | {t_old:.4f} "
                  f"| {t_new:.4f} | {t_old / t_new:.2f}x | {err:.1e} |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
