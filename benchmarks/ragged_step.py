"""Ragged decode steps as CUDA graphs (H200): the bucket's uniform graph (one split count for every
sequence, chosen for the top of its context bucket) against the ragged graph (the decode kernels
over a work list of fixed capacity, each sequence split in proportion to its context), and the eager
step (its own work list, launched kernel by kernel), all in one run.

    python benchmarks/ragged_step.py [--reps 20] [--out table.md]

Random bf16 weights, pages in random order; wall time a step with the host's part (staging the
step's buffers and work list included), median of --reps after a warm-up (`decode_step.timed`). The
last column: which graph `DecodeGraphs.ragged_splits` gives the step, and the longest sequence's
splits in the ragged graph's work list. (Correctness: tests/test_decode_graphs.py, GPU-marked.)
"""
from __future__ import annotations

import argparse
import random

import torch

from decode_step import BS, eager_step, print_rows, timed
from kernels import _make_importable  # noqa: E402  (maps kvmesh to shared/ without the install)

_make_importable()

from kvmesh.engine.decode_graphs import DecodeGraphs  # noqa: E402
from kvmesh.kernels.metadata import SeqSlice  # noqa: E402
from kvmesh.kernels.triton_backend import TritonBackend  # noqa: E402
from kvmesh.kv.layout import BlockLayout  # noqa: E402
from kvmesh.kv.pool import KVCache  # noqa: E402


def spread(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(lo, hi + 1) for _ in range(n)]


CASES = {  # shape -> (label, contexts of the step's sequences)
    "smollm2": [("1 x 8K + 63 x 512", [8192] + [512] * 63),
                ("64 spread 128-4K", spread(64, 128, 4096))],
    "llama3-8b": [("1 x 8K + 127 x 1K", [8192] + [1024] * 127),
                  ("4 x 8K + 60 x 1K", [8192] * 4 + [1024] * 60),
                  ("64 spread 256-4K", spread(64, 256, 4096)),
                  ("128 spread 256-2K", spread(128, 256, 2048))],
}


def run_case(model, name: str, kv: str, label: str, contexts: list[int], reps: int) -> str:
    cfg = model.config
    layout = BlockLayout(num_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         block_size=BS, kv_dtype=kv)
    batch = len(contexts)
    widths = [-(-(c + 1) // BS) for c in contexts]
    pages = list(range(sum(widths)))
    random.Random(0).shuffle(pages)
    tables, at = [], 0
    for w in widths:
        tables.append(pages[at:at + w])
        at += w
    cache = KVCache(layout, sum(widths), batch + 1, torch.bfloat16, "cuda")
    cache.pool.random_(0, 256)  # timing only: any bytes stream the same
    backend = TritonBackend()
    slices = [SeqSlice(c - 1, 1, tables[i], i) for i, c in enumerate(contexts)]  # prefix c - 1 + the new token
    tokens = [random.Random(i).randrange(cfg.vocab_size) for i in range(batch)]
    longest = max(contexts)

    def graphs(ragged: bool) -> DecodeGraphs:
        g = DecodeGraphs(model, cache, backend, max_seqs=batch, max_context=max(longest, 512), scratch_slot=batch)
        if not ragged:
            g.ragged_splits = lambda *a: 0  # every step through the bucket's uniform graph
        return g

    with torch.inference_mode():
        t_eager = timed(eager_step(model, cache, backend, slices, tokens), reps)
        uniform, ragged = graphs(False), graphs(True)
        t_uniform = timed(lambda: uniform.run(tokens, slices), reps)
        t_ragged = timed(lambda: ragged.run(tokens, slices), reps)
        assert uniform.failed is None and ragged.failed is None, (uniform.failed, ragged.failed)
        n, bucket, took_ragged = ragged.captured[-1]
        splits = ragged.ragged_splits(slices, n, bucket)
        used = "ragged" if took_ragged else "uniform"
    del cache, uniform, ragged
    torch.cuda.empty_cache()
    return (f"| {name} | {kv} | {label} | {t_eager * 1e3:.2f} | {t_uniform * 1e3:.2f} | {t_ragged * 1e3:.2f} | "
            f"{t_uniform / t_ragged:.2f}x | {used}, {splits} splits of the longest |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--kv", default="bf16,int4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = ["| model shape | kv | contexts | eager ms/step | uniform graph ms/step | ragged graph ms/step | "
             "uniform ÷ ragged | graph the step takes |",
             "|---|---|---|---|---|---|---|---|"]
    def rows_of(model, name):
        for kv in args.kv.split(","):
            for label, contexts in CASES[name]:
                yield f"{name} | {kv} | {label}", lambda: run_case(model, name, kv, label, contexts, args.reps)
    print_rows(lines, args.shapes.split(","), rows_of, args.out)

if __name__ == "__main__":
    main()
