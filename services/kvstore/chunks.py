"""Block <-> BlockChunk stream codec, shared by the kvstore server and its gRPC client.

A block travels as a header chunk (which also carries the first piece of data) followed by data-only
chunks until `header.size` bytes have arrived. A block no larger than one chunk is one message and its
bytes are never sliced or copied on the way.
"""
from __future__ import annotations

from typing import AsyncIterator, Iterator

from kvmesh.kvstore.block import StoredBlock
from kvmesh.wire import kvmesh_pb2 as pb


MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [  # server and client: a chunk plus its header exceeds gRPC's 4 MiB default only if
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),  # --chunk-bytes is raised; allow headroom
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class StreamError(ValueError):
    """A malformed chunk stream (data without a header, short or overlong block)."""


def block_chunks(block: StoredBlock, chunk_bytes: int) -> Iterator[pb.BlockChunk]:
    data = block.data
    header = pb.BlockHeader(hash=block.hash, size=len(data), crc32=block.checksum(), layout=block.layout,
                            token_ids=block.token_ids)
    if len(data) <= chunk_bytes:
        yield pb.BlockChunk(header=header, data=data)
        return
    view = memoryview(data)
    yield pb.BlockChunk(header=header, data=bytes(view[:chunk_bytes]))
    for start in range(chunk_bytes, len(data), chunk_bytes):
        yield pb.BlockChunk(data=bytes(view[start:start + chunk_bytes]))


def missing_chunk(block_hash: bytes) -> pb.BlockChunk:
    return pb.BlockChunk(header=pb.BlockHeader(hash=block_hash, missing=True))


async def assemble(chunks: AsyncIterator[pb.BlockChunk]) -> AsyncIterator[tuple[pb.BlockHeader, bytes | None]]:
    """Yields (header, data) per block in stream order; data (bytes or bytearray) is None when missing."""
    header: pb.BlockHeader | None = None
    first: bytes = b""
    buf: bytearray | None = None
    filled = 0
    async for chunk in chunks:
        if chunk.HasField("header"):
            if header is not None:
                raise StreamError(f"block {header.hash.hex()[:16]}: header arrived after {filled} of "
                                  f"{header.size} bytes")
            if chunk.header.missing:
                yield chunk.header, None
                continue
            header, first, buf, filled = chunk.header, chunk.data, None, len(chunk.data)
        elif header is None:
            raise StreamError("data chunk without a block header")
        else:
            if buf is None:  # second piece: switch to one preallocated buffer
                buf = bytearray(header.size)
                buf[:len(first)] = first
            end = filled + len(chunk.data)
            if end > header.size:
                raise StreamError(f"block {header.hash.hex()[:16]}: more than the {header.size} bytes "
                                  "its header announced")
            buf[filled:end] = chunk.data
            filled = end
        if filled > header.size:
            raise StreamError(f"block {header.hash.hex()[:16]}: more than the {header.size} bytes its "
                              "header announced")
        if filled == header.size:
            yield header, (first if buf is None else buf)  # bytearray when assembled: no extra copy
            header, first, buf, filled = None, b"", None, 0
    if header is not None:
        raise StreamError(f"stream ended inside block {header.hash.hex()[:16]} ({filled} of {header.size} bytes)")
