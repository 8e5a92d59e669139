"""The BlockChunk codec: byte-identical to protobuf both ways; streams assemble or fail loudly."""
from __future__ import annotations

import os
import random

import pytest

from kvmesh.kvstore.block import StoredBlock
from kvmesh.kvstore.chunks import (StreamError, assemble, batch_chunks, block_chunk_parts, block_chunks, decode_batch,
                                   decode_chunk, encode_chunk, missing_chunk, missing_chunk_parts, unbatched)
from kvmesh.wire import kvmesh_pb2 as pb


def header() -> pb.BlockHeader:
    return pb.BlockHeader(hash=os.urandom(32), size=random.randrange(1, 1 << 20), crc32=random.getrandbits(32),
                          layout="m/int4/16", token_ids=[random.randrange(1 << 31) for _ in range(16)])


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300_000])
def test_encode_equals_protobuf_and_decodes(size):
    h, data = header(), os.urandom(size)
    raw = encode_chunk(h, data)
    assert raw == pb.BlockChunk(header=h, data=data).SerializeToString()
    got_h, got_d = decode_chunk(raw)
    assert got_h == h and bytes(got_d) == data
    assert encode_chunk(None, data) == pb.BlockChunk(data=data).SerializeToString()
    assert decode_chunk(encode_chunk(None, data)) == (None, data if size else b"")


def test_decode_skips_unknown_fields_and_rejects_truncation():
    data = os.urandom(1000)
    raw = pb.BlockChunk(header=header(), data=data).SerializeToString()
    extra = b"\x18\x96\x01" + b"\x25\x01\x02\x03\x04" + b"\x2a\x03abc"  # varint, fixed32, bytes fields 3-5
    assert bytes(decode_chunk(raw + extra)[1]) == data
    with pytest.raises(StreamError):
        decode_chunk(raw[:-1])


async def _stream(items):
    for it in items:
        yield decode_chunk(it)


async def test_assemble_multi_chunk_blocks_and_missing():
    blocks = [StoredBlock(os.urandom(32), [1, 2, 3], os.urandom(n), "L") for n in (10_000, 4096, 9000)]
    gone = os.urandom(32)
    wire = list(block_chunks(blocks[0], 4096)) + [missing_chunk(gone)] + list(block_chunks(blocks[1], 4096)) \
        + list(block_chunks(blocks[2], 4096))
    assert len(wire) == 3 + 1 + 1 + 3
    out = [(h, d) async for h, d in assemble(_stream(wire))]
    assert [h.hash for h, _ in out] == [blocks[0].hash, gone, blocks[1].hash, blocks[2].hash]
    assert out[1][1] is None and out[1][0].missing
    for (h, d), b in zip([out[0], out[2], out[3]], blocks):
        assert bytes(d) == b.data and h.crc32 == b.checksum() and list(h.token_ids) == [1, 2, 3]


async def test_assemble_rejects_bad_streams():
    b = StoredBlock(os.urandom(32), [], os.urandom(10_000), "L")
    chunks = list(block_chunks(b, 4096))
    cases = {
        "without a block header": chunks[1:],
        "ended inside": chunks[:2],
        "header arrived after": chunks[:1] + chunks[:1],
        "more than the": chunks[:2] + [encode_chunk(None, os.urandom(5000))],
    }
    for msg, stream in cases.items():
        with pytest.raises(StreamError, match=msg):
            async for _ in assemble(_stream(stream)):
                pass


async def _batches(messages):
    for m in messages:
        yield decode_batch(m)


@pytest.mark.parametrize("batch_bytes,n_messages", [(1, 9), (5000, 4), (1 << 20, 1)])
async def test_batches_carry_the_same_chunks_and_blocks(batch_bytes, n_messages):
    """ChunkBatch messages hold consecutive chunks, several blocks' a message; the generated protobuf
    class reads them as we do, and the blocks reassemble byte for byte."""
    blocks = [StoredBlock(os.urandom(32), [i], os.urandom(n), "L") for i, n in enumerate((10_000, 4096, 1, 9000))]
    gone = os.urandom(32)
    parts = [p for b in blocks[:2] for p in block_chunk_parts(b, 4096)] + [missing_chunk_parts(gone)] \
        + [p for b in blocks[2:] for p in block_chunk_parts(b, 4096)]
    single = [b"".join(p) for p in parts]
    messages = list(batch_chunks(parts, batch_bytes))
    assert (len(single), len(messages)) == (9, n_messages)  # a message closes once it holds batch_bytes
    decoded = [c for m in messages for c in decode_batch(m)]
    assert [(h, bytes(d)) for h, d in decoded] == [(h, bytes(d)) for h, d in map(decode_chunk, single)]
    parsed = [c for m in messages for c in pb.ChunkBatch.FromString(m).chunks]
    assert [c.SerializeToString() for c in parsed] == [pb.BlockChunk.FromString(x).SerializeToString() for x in single]
    out = [(h, d) async for h, d in assemble(unbatched(_batches(messages)))]
    assert [h.hash for h, _ in out] == [blocks[0].hash, blocks[1].hash, gone, blocks[2].hash, blocks[3].hash]
    assert [bytes(d) for _, d in out if d is not None] == [b.data for b in blocks]


def test_decode_batch_rejects_bad_bytes():
    good = next(batch_chunks([missing_chunk_parts(os.urandom(32))], 1))
    with pytest.raises(StreamError, match="past the end"):
        decode_batch(good[:-1])
    with pytest.raises(StreamError, match="unexpected field"):
        decode_batch(b"\x12\x00")
