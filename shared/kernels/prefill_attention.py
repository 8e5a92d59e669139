"""Paged prefill / extend attention: a chunk of new query tokens per sequence attends to its cached
prefix (quantized full pages + full-precision residual tail) and, causally, to itself.

Used for chunked prefill and prefix-cache hits; sequences of a step may mix chunk lengths (a decode
sequence is a chunk of one). Tiles of BLOCK_M rows = tokens x the G query heads of one KV head.
"""
from __future__ import annotations

import torch

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.paged_attention import launch_paged_attention
from kvmesh.kv.pool import KVCache


def prefill_attention(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      meta: AttentionMetadata, scale: float, *, block_m: int = 128, block_n: int = 64,
                      num_warps: int = 8, num_stages: int = 2) -> torch.Tensor:
    """out [T, H, D] for q [T, H, D], k/v [T, KVH, D] (new tokens of every sequence, in order)."""
    return launch_paged_attention(cache, layer, q, k, v, meta, scale, block_m=block_m,
                                  block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                  max_query_len=meta.max_query_len)
