"""Block <-> BlockChunk stream codec, shared by the kvstore server and its gRPC client.

A block travels as a header chunk (which also carries the first piece of data) followed by data-only
chunks until `header.size` bytes have arrived.

The bulk path skips protobuf objects for BlockChunk: `encode_chunk` writes the message's wire bytes
itself (one copy of the data instead of two: into the message, then serialized) and `decode_chunk`
returns the data as a memoryview into the received message (no copy; the store writes it straight
into its slab). The bytes on the wire are exactly `kvmesh.v1.BlockChunk`, so clients and servers built
from the generated stubs interoperate.

`PutBatched` / `GetBatched` carry consecutive chunks of the same stream several to a message
(`kvmesh.v1.ChunkBatch`, about `chunk_bytes` a message): gRPC's cost is mostly per message, and a
small model's page is ~100 KiB. `batch_chunks` writes a batch's wire bytes in one join (the data is
copied once, as for a single chunk); `decode_batch` gives each chunk's data as a view into the
received message.
"""
from __future__ import annotations

from typing import AsyncIterator, Iterable, Iterator

from kvmesh.kvstore.block import StoredBlock
from kvmesh.wire import kvmesh_pb2 as pb

MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [  # server and client; headroom for a --chunk-bytes larger than gRPC's 4 MiB default
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

_HEADER_TAG = b"\x0a"  # field 1, wire type 2 (length-delimited)
_DATA_TAG = b"\x12"  # field 2, wire type 2

Chunk = tuple["pb.BlockHeader | None", "bytes | memoryview"]  # (header when present, data piece)


class StreamError(ValueError):
    """A malformed chunk stream (data without a header, short or overlong block, bad bytes)."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise StreamError("truncated or overlong varint in a BlockChunk")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _chunk_parts(header: pb.BlockHeader | None, data: bytes | memoryview) -> list:
    """The pieces of BlockChunk(header=header, data=data)'s wire bytes, not yet joined."""
    parts = []
    if header is not None:
        h = header.SerializeToString()
        parts += [_HEADER_TAG, _varint(len(h)), h]
    if len(data):
        parts += [_DATA_TAG, _varint(len(data)), data]
    return parts


def encode_chunk(header: pb.BlockHeader | None, data: bytes | memoryview) -> bytes:
    """Wire bytes of BlockChunk(header=header, data=data)."""
    return b"".join(_chunk_parts(header, data))


def decode_chunk(raw: bytes | memoryview) -> Chunk:
    """(header or None, data as a memoryview into `raw`) of one BlockChunk's wire bytes."""
    buf = memoryview(raw)
    header: pb.BlockHeader | None = None
    data: bytes | memoryview = b""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 2:
            n, pos = _read_varint(buf, pos)
            if pos + n > len(buf):
                raise StreamError("BlockChunk field runs past the end of the message")
            if field == 1:  # repeated occurrences of a message field merge, as protobuf does
                header = header or pb.BlockHeader()
                header.MergeFromString(buf[pos:pos + n])
            elif field == 2:
                data = buf[pos:pos + n]
            pos += n
        elif wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise StreamError(f"BlockChunk: unsupported wire type {wire_type} for field {field}")
    return header, data


def block_header(block: StoredBlock) -> pb.BlockHeader:
    """What travels ahead of a block's bytes, on every path (chunks, shared memory)."""
    return pb.BlockHeader(hash=block.hash, size=len(block.data), crc32=block.checksum(), layout=block.layout,
                          token_ids=block.token_ids)


def block_chunk_parts(block: StoredBlock, chunk_bytes: int) -> Iterator[list]:
    """Each chunk of one block as its wire pieces (`_chunk_parts`), not yet joined."""
    data = block.data
    header = block_header(block)
    view = memoryview(data)
    yield _chunk_parts(header, view[:chunk_bytes])
    for start in range(chunk_bytes, len(data), chunk_bytes):
        yield _chunk_parts(None, view[start:start + chunk_bytes])


def block_chunks(block: StoredBlock, chunk_bytes: int) -> Iterator[bytes]:
    """Encoded chunks of one block; a block no larger than a chunk is one message."""
    for parts in block_chunk_parts(block, chunk_bytes):
        yield b"".join(parts)


def missing_chunk_parts(block_hash: bytes) -> list:
    return _chunk_parts(pb.BlockHeader(hash=block_hash, missing=True), b"")


def missing_chunk(block_hash: bytes) -> bytes:
    return b"".join(missing_chunk_parts(block_hash))


def batch_chunks(chunks: Iterable[list], batch_bytes: int) -> Iterator[bytes]:
    """ChunkBatch wire bytes of consecutive chunks (each given as its pieces), a message once it
    holds at least `batch_bytes` (the last one whatever is left)."""
    parts: list = []
    size = 0
    for pieces in chunks:
        n = sum(len(p) for p in pieces)
        parts += [_HEADER_TAG, _varint(n), *pieces]  # ChunkBatch.chunks is field 1, length-delimited
        size += n
        if size >= batch_bytes:
            yield b"".join(parts)
            parts, size = [], 0
    if parts:
        yield b"".join(parts)


def decode_batch(raw: bytes) -> list[Chunk]:
    """The chunks of one ChunkBatch's wire bytes, in order (data as views into `raw`)."""
    buf = memoryview(raw)
    out = []
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        if key != 0x0A:
            raise StreamError(f"ChunkBatch: unexpected field key {key}")
        n, pos = _read_varint(buf, pos)
        if pos + n > len(buf):
            raise StreamError("ChunkBatch chunk runs past the end of the message")
        out.append(decode_chunk(buf[pos:pos + n]))
        pos += n
    return out


async def unbatched(batches: AsyncIterator[list[Chunk]]) -> AsyncIterator[Chunk]:
    """The chunks of a stream of decoded batches, one at a time (what `assemble` reads)."""
    async for batch in batches:
        for chunk in batch:
            yield chunk


async def assemble(chunks: AsyncIterator[Chunk]) -> AsyncIterator[tuple[pb.BlockHeader, bytes | memoryview | None]]:
    """Yields (header, data) per block in stream order; data is None for a block flagged missing.

    A one-chunk block's data is the chunk's memoryview; a longer one is assembled in one bytearray.
    """
    header: pb.BlockHeader | None = None
    first: bytes | memoryview = b""
    buf: bytearray | None = None
    filled = 0
    async for chunk_header, piece in chunks:
        if chunk_header is not None:
            if header is not None:
                raise StreamError(f"block {header.hash.hex()[:16]}: header arrived after {filled} of "
                                  f"{header.size} bytes")
            if chunk_header.missing:
                yield chunk_header, None
                continue
            header, first, buf, filled = chunk_header, piece, None, len(piece)
        elif header is None:
            raise StreamError("data chunk without a block header")
        else:
            if buf is None:  # second piece: switch to one preallocated buffer
                buf = bytearray(header.size)
                buf[:len(first)] = first
            end = filled + len(piece)
            if end > header.size:
                raise StreamError(f"block {header.hash.hex()[:16]}: more than the {header.size} bytes "
                                  "its header announced")
            buf[filled:end] = piece
            filled = end
        if filled > header.size:
            raise StreamError(f"block {header.hash.hex()[:16]}: more than the {header.size} bytes its "
                              "header announced")
        if filled == header.size:
            yield header, (first if buf is None else buf)
            header, first, buf, filled = None, b"", None, 0
    if header is not None:
        raise StreamError(f"stream ended inside block {header.hash.hex()[:16]} ({filled} of {header.size} bytes)")
