"""The prefill kernel's tile choices on the H200, at the shapes it serves: every (BLOCK_M, BLOCK_N,
warps, stages, causal split) variant timed in one run (CUDA graph of 10 calls, CUDA events, median, as
benchmarks/kernels.py times), each checked against the default variant's output; then, at the
launch the kernel uses for the shape, the order its tiles are dispatched in:

    python3 benchmarks/prefill_sweep.py [--reps 20] [--shapes smollm2,llama3-8b] [--kv int4] [--orders-only]

Cases: a serving step's prompts (8 fresh prompts of 256-1,792 tokens, 8,192 in all: what a prompt
step of `gpu_serving.py` holds), 4 chunks of 2,048 over a 2,048-token prefix of `--kv` pages read
in place (a prompt graph stages no page), and a serving mix (62 decode rows over 256-2,048 cached
tokens, then fresh prompts to 8,192 rows). Prints one table per case: µs and the ratio to the default.
Orders: the eager grid (a sequence's tiles first to last) and a prompt graph's tile list (sequences
by prefix, the old order, or the heaviest tiles first, `tile_order.py`)."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import random

import numpy as np
import torch

import kernels as kb  # benchmarks/kernels.py (puts kvmesh on the path too)
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata
from kvmesh.kernels.paged_attention import tile_tokens
from kvmesh.kernels.prefill_attention import DEFAULT_LAUNCH, TILE_LAUNCH, prefill_attention
from kvmesh.kernels.tile_order import tile_list
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache

SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # query heads, KV heads, head_dim
BS = 16
DEFAULT = (128, 64, 8, 2, False)
# BLOCK_M, BLOCK_N, warps, stages, causal split (the keys before a tile's first token unmasked)
VARIANTS = list(itertools.product((128,), (64, 128), (4, 8), (2, 3), (False, True)))


def case(shape: tuple[int, int, int], prompts: list[int], prefixes: list[int], kv: str):
    """(cache, meta, q, k, v) for chunks of `prompts` new tokens over `prefixes` cached (full pages
    in random order, read in place)."""
    H, KVH, D = shape
    g = torch.Generator(device="cuda").manual_seed(3)
    T = sum(prompts)
    per = [p // BS for p in prefixes]
    pages = sum(per) + 1
    layout = BlockLayout(num_layers=1, kv_heads=KVH, head_dim=D, block_size=BS, kv_dtype=kv)
    cache = KVCache(layout, pages, 1, torch.float16, "cuda")
    if pages > 1:
        kp = torch.randn((pages - 1) * BS, KVH, D, device="cuda", dtype=torch.float16, generator=g)
        vp = torch.randn_like(kp)
        rows = torch.arange((pages - 1) * BS, device="cuda").view(-1, BS) + BS
        kb.write_blocks(cache, 0, kp, vp, rows, torch.randperm(pages - 1, device="cuda", generator=g) + 1)
    first = [1 + sum(per[:i]) for i in range(len(per))]
    seqs = [SeqSlice(p // BS * BS, n, list(range(f, f + c)) + [0] * (n // BS + 1), 0)
            for p, n, f, c in zip(prefixes, prompts, first, per)]
    meta = build_attention_metadata(seqs, layout, 1, "cuda")
    meta.stage = None  # read in place, as a prompt graph does
    q = torch.randn(T, H, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(T, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(T, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    return cache, meta, q, k, v


def orders(meta, prompts: list[int], prefixes: list[int], tile_tokens: int) -> dict:
    """name -> metadata for each dispatch order of the same tiles."""
    p, n = np.array(prefixes) // BS * BS, np.array(prompts)
    heaviest = tile_list(p, n, tile_tokens)
    by_prefix = np.concatenate([(b << 16) | np.arange(-(-n[b] // tile_tokens)) for b in np.argsort(-p, kind="stable")])

    def listed(entries):
        return dataclasses.replace(meta, tiles=torch.tensor(entries, dtype=torch.int32, device="cuda"))
    return {"grid, first tile first": meta, "tile list, longest prefix first": listed(by_prefix),
            "tile list, heaviest first": listed(heaviest)}


def variants_table(run, reps: int, title: str, name: str) -> None:
    """Every variant of VARIANTS timed against DEFAULT (µs, ratio, output distance)."""
    ref = run(*DEFAULT).float()
    base = kb.time_ms(lambda: run(*DEFAULT), reps)
    print(f"\n{name}, {title}: default {DEFAULT} {base * 1e3:.1f} µs", flush=True)
    print("| BLOCK_M | BLOCK_N | warps | stages | causal split | µs | default ÷ this | rel. L2 vs default |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for var in VARIANTS:
        try:
            err = ((run(*var).float() - ref).norm() / ref.norm()).item()
            t = kb.time_ms(lambda: run(*var), reps)
        except Exception as e:  # a variant that does not fit (shared memory, registers)
            print(f"| {' | '.join(map(str, var))} | failed: {type(e).__name__} | | |", flush=True)
            continue
        results.append((t, var))
        print(f"| {' | '.join(map(str, var))} | {t * 1e3:.1f} | {base / t:.3f} | {err:.1e} |", flush=True)
    t, var = min(results)
    print(f"best: {var} {t * 1e3:.1f} µs, {base / t:.3f}x the default", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--kv", default="int4", help="the cached pages' KV dtype")
    ap.add_argument("--orders-only", action="store_true", help="only the orders table, at the launch in use")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    rng = random.Random(0)
    serving = [rng.randrange(256, 1792) for _ in range(7)]
    serving.append(8192 - sum(serving))
    decode_prefixes = [rng.randrange(256, 2048) for _ in range(62)]
    fresh = serving[:-1] + [serving[-1] - 62]
    cases = ((f"8 prompts, {serving} tokens", serving, [0] * 8),
             (f"4 x 2048 over 2048 {a.kv} in place", [2048] * 4, [2048] * 4),
             (f"62 decode rows over 256-2048 {a.kv}, then the 8 prompts", [1] * 62 + fresh, decode_prefixes + [0] * 8))
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        for title, prompts, prefixes in cases:
            cache, meta, q, k, v = case(shape, prompts, prefixes, a.kv)
            scale = shape[2] ** -0.5

            def run(bm, bn, w, s, split, m=meta):
                return prefill_attention(cache, 0, q, k, v, m, scale, block_m=bm, block_n=bn, num_warps=w,
                                         num_stages=s, staging=False, causal_split=split)
            if not a.orders_only:
                variants_table(run, a.reps, title, name)
            warps, stages, split = TILE_LAUNCH.get(shape[2], DEFAULT_LAUNCH)
            launch = (128, 64, warps, stages, split)
            print(f"\n{name}, {title}: orders at the launch in use {launch}:")
            print("| order | µs | first tile first ÷ this | rel. L2 vs first tile first |")
            print("|---|---|---|---|")
            first = kb.time_ms(lambda: run(*launch), a.reps)
            ref = run(*launch).float()
            tok = tile_tokens(shape[0] // shape[1], 128)
            for label, m in orders(meta, prompts, prefixes, tok).items():
                err = ((run(*launch, m=m).float() - ref).norm() / ref.norm()).item()
                t = kb.time_ms(lambda: run(*launch, m=m), a.reps)
                print(f"| {label} | {t * 1e3:.1f} | {first / t:.3f} | {err:.1e} |", flush=True)
            del cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
