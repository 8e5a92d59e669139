"""The prefill kernel's tile choices on the H200, at the shapes it serves: every (BLOCK_M, BLOCK_N,
warps, stages, causal split) variant timed in one run (CUDA graph of 10 calls, CUDA events, median, as
benchmarks/kernels.py times), each checked against the default variant's output:

    python3 benchmarks/prefill_sweep.py [--reps 20] [--shapes smollm2,llama3-8b]

Cases: a serving step's prompts (8 fresh prompts of 256-1,792 tokens, 8,192 in all: what a prompt
step of `gpu_serving.py` holds) and 4 chunks of 2,048 over a 2,048-token INT4 prefix read in place
(a prompt graph stages no page). Prints one table per case: µs and the ratio to the default."""
from __future__ import annotations

import argparse
import itertools
import random

import torch

import kernels as kb  # benchmarks/kernels.py (puts kvmesh on the path too)
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata
from kvmesh.kernels.prefill_attention import prefill_attention
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache

SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # query heads, KV heads, head_dim
BS = 16
DEFAULT = (128, 64, 8, 2, False)
# BLOCK_M, BLOCK_N, warps, stages, causal split (the keys before a tile's first token unmasked)
VARIANTS = list(itertools.product((128,), (64, 128), (4, 8), (2, 3), (False, True)))


def case(shape: tuple[int, int, int], prompts: list[int], prefix: int, kv: str):
    """(cache, meta, q, k, v) for fresh or extended chunks of `prompts` tokens over `prefix` cached."""
    H, KVH, D = shape
    g = torch.Generator(device="cuda").manual_seed(3)
    T = sum(prompts)
    pages = len(prompts) * (prefix // BS) + 1
    layout = BlockLayout(num_layers=1, kv_heads=KVH, head_dim=D, block_size=BS, kv_dtype=kv)
    cache = KVCache(layout, pages, 1, torch.float16, "cuda")
    if prefix:
        kp = torch.randn((pages - 1) * BS, KVH, D, device="cuda", dtype=torch.float16, generator=g)
        vp = torch.randn_like(kp)
        rows = torch.arange((pages - 1) * BS, device="cuda").view(-1, BS) + BS
        kb.write_blocks(cache, 0, kp, vp, rows, torch.randperm(pages - 1, device="cuda", generator=g) + 1)
    per = prefix // BS
    seqs = [SeqSlice(prefix, n, list(range(1 + i * per, 1 + (i + 1) * per)) + [0] * (n // BS + 1), 0)
            for i, n in enumerate(prompts)]
    meta = build_attention_metadata(seqs, layout, 1, "cuda")
    meta.stage = None  # read in place, as a prompt graph does
    q = torch.randn(T, H, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(T, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(T, KVH, D, device="cuda", dtype=torch.float16, generator=g)
    return cache, meta, q, k, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    rng = random.Random(0)
    serving = [rng.randrange(256, 1792) for _ in range(7)]
    serving.append(8192 - sum(serving))
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        for title, prompts, prefix in ((f"8 prompts, {serving} tokens", serving, 0),
                                       ("4 x 2048 over 2048 int4 in place", [2048] * 4, 2048)):
            cache, meta, q, k, v = case(shape, prompts, prefix, "int4")
            scale = shape[2] ** -0.5

            def run(bm, bn, w, s, split):
                return prefill_attention(cache, 0, q, k, v, meta, scale, block_m=bm, block_n=bn, num_warps=w,
                                         num_stages=s, staging=False, causal_split=split)
            ref = run(*DEFAULT).float()
            base = kb.time_ms(lambda: run(*DEFAULT), a.reps)
            print(f"\n{name}, {title}: default {DEFAULT} {base * 1e3:.1f} µs", flush=True)
            print("| BLOCK_M | BLOCK_N | warps | stages | causal split | µs | default ÷ this | rel. L2 vs default |")
            print("|---|---|---|---|---|---|---|---|")
            results = []
            for var in VARIANTS:
                try:
                    err = ((run(*var).float() - ref).norm() / ref.norm()).item()
                    t = kb.time_ms(lambda: run(*var), a.reps)
                except Exception as e:  # a variant that does not fit (shared memory, registers)
                    print(f"| {' | '.join(map(str, var))} | failed: {type(e).__name__} | | |", flush=True)
                    continue
                results.append((t, var))
                print(f"| {' | '.join(map(str, var))} | {t * 1e3:.1f} | {base / t:.3f} | {err:.1e} |", flush=True)
            t, var = min(results)
            print(f"best: {var} {t * 1e3:.1f} µs, {base / t:.3f}x the default", flush=True)
            del cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
