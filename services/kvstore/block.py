"""StoredBlock: one KV block as it travels between services (one buffer, never re-encoded)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.kvstore.checksum import crc32 as _crc32


@dataclass
class StoredBlock:
    hash: bytes
    """32-byte chained block hash (the block's identity)."""
    token_ids: list[int]
    """The block's tokens, checked by the reader on a hit."""
    data: bytes
    """The block's page bytes (data and scales of every layer), as BlockLayout lays them out."""
    layout: str
    """Layout id: model, kv dtype, block size, layers, heads, head_dim."""
    crc32: int | None = field(default=None, compare=False, repr=False)
    """zlib.crc32 of data when known (the store keeps it; None: compute on send)."""
    shared: tuple[str, int] | None = field(default=None, compare=False, repr=False)
    """(segment, offset) where `data` lies in a shared-memory segment of this host: a put over
    shared memory names it instead of copying the bytes (an engine process's exported pages)."""

    def checksum(self) -> int:
        if self.crc32 is None:
            self.crc32 = _crc32(self.data)
        return self.crc32
