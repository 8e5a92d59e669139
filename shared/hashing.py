"""Chained, content-addressed block hashes, identical in every process (no torch, no `hash()`).

    h_i = SHA-256(h_{i-1} || token ids of block i || extra keys)

`h_{-1}` is a seed derived from the extra keys (model identity, KV dtype, block size, cache salt), so
two requests share a block only if they share every earlier token *and* every extra key. Only full
blocks get a hash.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

BlockHash = bytes  # 32 bytes of SHA-256


@dataclass(frozen=True)
class HashContext:
    """The extra keys that make a block's identity: what must match for two blocks to be the same."""

    model_id: str
    """Model identity (name plus a digest of its weights' metadata)."""
    kv_dtype: str
    """Canonical KV dtype: blocks quantized differently are different blocks."""
    block_size: int
    cache_salt: str = ""
    """Per-tenant salt (the request's `cache_salt`): blocks of different salts never match."""

    def seed(self) -> BlockHash:
        key = f"kvmesh/v1\0{self.model_id}\0{self.kv_dtype}\0{self.block_size}\0{self.cache_salt}"
        return hashlib.sha256(key.encode()).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash. Token ids are packed as little-endian u32."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def block_hashes(token_ids: Sequence[int], ctx: HashContext, start: int = 0,
                 parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of every *full* block of `token_ids`, in order.

    `start` (a multiple of block_size) and `parent` let a caller extend a chain it already has.
    """
    bs = ctx.block_size
    if start % bs:
        raise ValueError("start must be a multiple of block_size")
    prev = ctx.seed() if parent is None else parent
    out: list[BlockHash] = []
    for i in range(start, len(token_ids) - bs + 1, bs):
        prev = hash_block(prev, token_ids[i:i + bs])
        out.append(prev)
    return out
