"""Decode over ragged batches (one long sequence among short ones) on the H200: the batch's work
list (each sequence split in proportion to its context, `kvmesh.kernels.work_list`) against one
split count for every sequence (the metadata without its contexts: the count a batch all at the
longest context takes), each KV dtype on the engine's path, timed as benchmarks/kernels.py times
(CUDA graph of 10 calls, median of replays). Beside them: the same batch with the same tokens spread
evenly (every context the mean), which no schedule of the ragged batch can beat by much, and the
rel. L2 between the two schedules' outputs.

    python3 benchmarks/ragged_decode.py [--reps 20] [--dtypes fp16,fp8_e4m3,int8,int4]
    python3 benchmarks/ragged_decode.py --split-sweep 16,32,64,128 --profile   # where the time goes

`--split-sweep` times the work list at each given split count of the longest sequence (the
launcher's choice beside them); `--profile` prints each launch's kernels' CUDA time (torch profiler).
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
from kvmesh.kernels.work_list import BatchContexts  # noqa: E402

# (batch, the long sequence's context, every other sequence's context)
CASES = [(64, 32768, 1024), (128, 16384, 512), (32, 131072, 2048), (8, 32768, 4096)]
GQA, D, BS, KVH = 4, 128, 16, 8
RESIDENT = 16  # one-warp direct kernels (the plain kernels' counts differ; the table shows these)


def build(kv: str, lens: list[int], seed: int):
    from test_kernels_attention import make_case

    dt = torch.bfloat16 if kv == "bf16" else torch.float16
    return make_case(kv, GQA, D, BS, lens, [1] * len(lens), kv_heads=KVH, num_layers=1, layer=0,
                     device="cuda", seed=seed, model_dtype=dt)


def time_even(kv: str, batch: int, total: int, reps: int) -> float:
    """ms of a batch of the same size and tokens, every context the mean."""
    cache, meta, q, k, v = build(kv, [total // batch - 1] * batch, batch + 1)
    t = kb.time_ms(lambda: decode_attention(cache, 0, q, k, v, meta, D ** -0.5), reps)
    del cache
    return t


def time_case(kv: str, batch: int, long: int, short: int, reps: int) -> tuple[float, float, float]:
    """(ms with the work list, ms with one count for all, rel. L2 between their outputs)."""
    cache, meta, q, k, v = build(kv, [long] + [short] * (batch - 1), batch)
    one_count = dataclasses.replace(meta, contexts=None)  # as if every sequence were the longest
    scale = D ** -0.5
    a = decode_attention(cache, 0, q, k, v, meta, scale).float()
    b = decode_attention(cache, 0, q, k, v, one_count, scale).float()
    err = ((a - b).norm() / b.norm()).item()
    t_work = kb.time_ms(lambda: decode_attention(cache, 0, q, k, v, meta, scale), reps)
    t_one = kb.time_ms(lambda: decode_attention(cache, 0, q, k, v, one_count, scale), reps)
    return t_work, t_one, err


def sweep(kv: str, batch: int, long: int, short: int, counts: list[int], reps: int, profile: bool) -> str:
    """One table row: ms of the work list at each count, then the launcher's own count; with
    `profile`, each launch's kernels (CUDA µs per call) after it."""
    cache, meta, q, k, v = build(kv, [long] + [short] * (batch - 1), batch)
    cells, kernels = [], []
    for s in counts + [None]:
        def call():
            return decode_attention(cache, 0, q, k, v, meta, D ** -0.5, splits=s)
        cells.append(f"{kb.time_ms(call, reps):.4f}")
        if profile:
            from torch.profiler import ProfilerActivity, profile as prof
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(10):
                    call()
                torch.cuda.synchronize()
            kernels.append(f"{s or 'own'}: " + ", ".join(
                f"{e.key[:40]} {e.device_time_total / 10:.1f}" for e in p.key_averages() if e.device_time_total > 0))
    return f"| {batch}: 1 x {long} + {batch - 1} x {short} | {kv} | " + " | ".join(cells) + " |" + \
        "".join(f"\n    {x}" for x in kernels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtypes", default="fp16,fp8_e4m3,int8,int4")
    ap.add_argument("--split-sweep", default="", help="comma-separated split counts of the longest sequence")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    sms = num_sms(torch.device("cuda"))
    if a.split_sweep:
        counts = [int(x) for x in a.split_sweep.split(",")]
        print("| batch: long + short contexts | kv | " + " | ".join(f"ms at {c}" for c in counts) +
              " | ms at the launcher's |\n|---|---|" + "---|" * (len(counts) + 1))
        for batch, long, short in CASES:
            for kv in a.dtypes.split(","):
                print(sweep(kv, batch, long, short, counts, a.reps, a.profile), flush=True)
                torch.cuda.empty_cache()
        return
    print(f"| batch: long + short contexts | kv | splits, one count -> work list (units), at {RESIDENT} programs "
          "an SM | ms one count | ms work list | speedup | rel. L2 | ms same tokens, even | work list / even |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for batch, long, short in CASES:
        lens = [long + 1] + [short + 1] * (batch - 1)
        ctx = BatchContexts.of(lens)
        one, work = (num_splits(batch, KVH, long + 1, sms, RESIDENT, BS, c) for c in (None, ctx))
        for kv in a.dtypes.split(","):
            t_work, t_one, err = time_case(kv, batch, long, short, a.reps)
            torch.cuda.empty_cache()
            t_even = time_even(kv, batch, sum(lens), a.reps)
            print(f"| {batch}: 1 x {long} + {batch - 1} x {short} | {kv} | {one} -> {work} ({ctx.units(work)}) "
                  f"| {t_one:.4f} | {t_work:.4f} | {t_one / t_work:.2f}x | {err:.1e} | {t_even:.4f} "
                  f"| {t_work / t_even:.2f}x |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
