"""`TritonBackend`: the GPU attention backend built on the fused Triton kernels.

attend: `decode_attention` when every sequence has one new token, else `prefill_attention`; a
mixed step split by the metadata (`MixedSplit`) runs its decode rows through the first, the rest
through the second; a prompt step's CUDA graph (`engine/chunk_batch.py`) is not split: its tile
list (`AttentionMetadata.tiles`) sends every row, decode rows too, to the prefill kernel.
write: `cache_write.write_blocks` quantizes completed blocks into their pages (-1 ids skipped),
then `cache_write.copy_to_residual` copies the leftover rows to the residual slots in one launch (in
that order: the block kernel reads residual rows that the copy may overwrite).
"""
from __future__ import annotations

import torch

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.cache_write import copy_to_residual, write_blocks
from kvmesh.kernels.decode_attention import decode_attention
from kvmesh.kernels.prefill_attention import prefill_attention
from kvmesh.kv.pool import KVCache


class TritonBackend:
    """Implements `kvmesh.kernels.backend.AttentionBackend` with Triton kernels (GPU, or the
    Triton interpreter on the CPU for tests)."""

    name = "triton"

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k, v = _head_rows(k), _head_rows(v)
        if meta.is_decode:
            return decode_attention(cache, layer, q, k, v, meta, scale)
        if meta.mixed is None:
            return prefill_attention(cache, layer, q, k, v, meta, scale)
        m = meta.mixed  # decode rows to the decode kernel, the chunks to the prefill kernel
        out = torch.empty_like(q)
        d, p = m.decode_rows, m.prefill_rows
        out[d] = decode_attention(cache, layer, q[d], k[d], v[d], m.decode, scale)
        if isinstance(p, slice):  # the chunks' rows in one run: the kernel writes them in place
            prefill_attention(cache, layer, q[p], k[p], v[p], m.prefill, scale, out=out[p])
        else:
            out[p] = prefill_attention(cache, layer, q[p], k[p], v[p], m.prefill, scale)
        return out

    def write(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor,
              meta: AttentionMetadata) -> None:
        plan = meta.write
        k, v = _head_rows(k), _head_rows(v)
        # a decode batch's plan: the leftover rows ride in the blocks' launch
        paired = (plan.residual_src, plan.residual_dst) if plan.paired else None
        write_blocks(cache, layer, k, v, plan.block_rows, plan.block_ids, residual=paired)
        if paired is None:
            copy_to_residual(cache, layer, k, v, plan.residual_src, plan.residual_dst)


def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, KVH, D] as the kernels read it: rows at any stride, heads and channels contiguous. The
    model's k and v are views into its qkv projection that already are (a copy would be two more
    kernels a layer, twice: attend and write)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()
