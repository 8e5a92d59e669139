"""Paged decode attention (one new token per sequence) over the quantized KV pool.

One program per (sequence, KV head, split) serves the G query heads of that KV head, so every page
is read once. When batch x KV heads is small next to the GPU's multiprocessors the full pages are
split across programs (flash-decoding) and `reduce_splits_kernel` combines them. The split count
comes from shapes only (batch, KV heads, `meta.max_prefix_len`): no host sync, fixed grid.
"""
from __future__ import annotations

import torch
import triton

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.paged_attention import launch_paged_attention
from kvmesh.kv.pool import KVCache

NUM_SMS_DEFAULT = 132  # H200; the real count is read from the device when there is one
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism
MAX_SPLITS = 32


def num_splits(batch: int, kv_heads: int, max_context: int, num_sms: int) -> int:
    """Programs wanted: about 2 waves of one program per SM; splits fill what batch x KVH lacks
    (measured on the H200: 8 x 32768 is fastest at 4-8 splits, 64 x 4096 does not gain from any)."""
    programs = batch * kv_heads
    want = triton.cdiv(2 * num_sms, programs)
    cap = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


def decode_attention(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata, scale: float, *, splits: int | None = None,
                     block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                     native_cvt: bool = False, maxnreg: int | None = None) -> torch.Tensor:
    """out [B, H, D] for q [B, H, D] (one new token per sequence, k/v [B, KVH, D] its new K/V).
    `splits`/`block_n`/`num_warps`/`num_stages` override the defaults (benchmarks, tests);
    `native_cvt` converts fp8/int8 with the hardware instructions instead of bit operations;
    `maxnreg` caps registers per thread (ncu: 144 registers limit the kernel to 3 CTAs per SM)."""
    if meta.max_query_len != 1 or q.shape[0] != meta.num_seqs:
        raise ValueError(f"decode needs one new token per sequence: max_query_len={meta.max_query_len}, "
                         f"T={q.shape[0]}, B={meta.num_seqs}")
    L = cache.layout
    if splits is None:
        splits = num_splits(meta.num_seqs, L.kv_heads, meta.max_prefix_len + 1, _num_sms(q.device))
    if block_n is None:
        block_n = max(64, L.block_size)
    return launch_paged_attention(cache, layer, q, k, v, meta, scale, block_m=16, block_n=block_n,
                                  splits=splits, num_warps=num_warps, num_stages=num_stages,
                                  max_query_len=1, native_cvt=native_cvt, maxnreg=maxnreg)
