"""Paged prefill / extend attention: a chunk of new query tokens per sequence attends to its cached
prefix (quantized full pages + full-precision residual tail) and, causally, to itself.

Used for chunked prefill and prefix-cache hits; sequences of a step may mix chunk lengths (a decode
sequence is a chunk of one). Tiles of BLOCK_M rows = tokens x the G query heads of one KV head.
"""
from __future__ import annotations

import torch

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.paged_attention import PREFILL_BLOCK_M, launch_paged_attention
from kvmesh.kernels.prefix_stage import stage_prefix
from kvmesh.kv.pool import KVCache


# (warps, stages, causal split) by head_dim, against the (8, 2, no split) launch (H200,
# benchmarks/prefill_sweep.py, 2026-12-03): at SmolLM2's heads (9 over 3, D 64) 1.50x on a step's
# 8 fresh prompts, 1.38x on 2,048-token chunks over 2,048 INT4 pages read in place; at Llama-3-8B's
# (32 over 8, D 128) 1.25x, 1.03x, and 1.06x on decode rows mixed with fresh prompts (BLOCK_N 128,
# 8 warps, 2 stages, split: 1.15x, 1.17x, 1.10x, but twice the shared memory a stage, more than
# pre-Hopper parts hold at some launches; untaken); elsewhere (8, 2, no split)
TILE_LAUNCH = {64: (4, 3, True), 128: (8, 3, True)}
DEFAULT_LAUNCH = (8, 2, False)


def prefill_attention(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      meta: AttentionMetadata, scale: float, *, block_m: int = PREFILL_BLOCK_M, block_n: int = 64,
                      num_warps: int | None = None, num_stages: int | None = None, staging: bool = True,
                      out: torch.Tensor | None = None, causal_split: bool | None = None) -> torch.Tensor:
    """out [T, H, D] for q [T, H, D], k/v [T, KVH, D] (new tokens of every sequence, in order),
    written into `out` when given. The prefix pages of `meta.stage` are dequantized into a workspace
    first (`staging=False` reads every page in place, for comparison). `num_warps`, `num_stages`,
    `causal_split` None: TILE_LAUNCH's for head_dim D."""
    warps, stages, split = TILE_LAUNCH.get(q.shape[2], DEFAULT_LAUNCH)
    num_warps, num_stages = num_warps or warps, num_stages or stages
    causal_split = split if causal_split is None else causal_split
    workspace = stage_prefix(cache, layer, meta.stage) if staging and meta.stage is not None else None
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if workspace is not None and q.dtype == torch.bfloat16:
        # the staged kernel's MMAs are fp16: cast once here rather than in every tile's loads
        q, k, v = q.to(torch.float16), k.to(torch.float16), v.to(torch.float16)
    return launch_paged_attention(cache, layer, q, k, v, meta, scale, block_m=block_m,
                                  block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                  max_query_len=meta.max_query_len, workspace=workspace,
                                  out=out, causal_split=causal_split)
