"""Blocks through shared memory on one host (PutShared / GetShared): the client's arena, the round
trip over real gRPC, the fallbacks (a node that cannot open the segment, a get larger than its
reservation, a full arena) and the server's checks on names and ranges."""
from __future__ import annotations

import os
import random
import zlib

import grpc
import pytest

from kvmesh.kvstore.chunks import GRPC_OPTIONS
from kvmesh.kvstore.client import GrpcKVStoreClient, StoredBlock
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.server import KVStoreServer
from kvmesh.shm_arena import SegmentRange, ShmArena
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc

RPC_TIMEOUT = 10.0


def blocks(n: int, size: int) -> list[StoredBlock]:
    return [StoredBlock(os.urandom(32), [random.randrange(1000) for _ in range(16)], os.urandom(size), "L")
            for _ in range(n)]


@pytest.fixture
async def node():
    server = KVStoreServer(KVStoreConfig(host="127.0.0.1", port=0, capacity_bytes=8 << 20, block_bytes=512 << 10,
                                         device="cpu", publish_interval=0.05))
    await server.start()
    yield server
    await server.stop(grace=0.5)


def test_arena_first_fit_merges_freed_neighbours():
    arena = ShmArena.create(4096)
    try:
        a, b, c = arena.alloc(100), arena.alloc(1000), arena.alloc(64)
        assert (a, b, c) == (0, 128, 1152)  # 64-byte aligned ranges, first fit
        assert arena.alloc(4096) is None
        arena.free(b, 1000)
        assert arena.alloc(900) == 128  # the freed hole
        arena.free(128, 900)
        arena.free(a, 100)
        arena.free(c, 64)
        assert arena._free == [(0, 4096)]  # everything merged back
        arena.view(10, 3)[:] = b"abc"
        assert bytes(arena.view(10, 3)) == b"abc"
    finally:
        arena.close()


async def test_blocks_round_trip_through_shared_memory(node):
    client = GrpcKVStoreClient([node.address], shared_memory_bytes=4 << 20)
    try:
        bs = blocks(5, 200_000)
        assert await client.put(bs) == 5
        assert list(node._servicer.segments._open) == [client._arena.name]  # it went through the segment
        missing = os.urandom(32)
        got = await client.get([bs[3].hash, missing, bs[0].hash], lease_holder="d", lease_seconds=5)
        assert got == [bs[3], None, bs[0]]
        assert client._arena._free == [(0, 4 << 20)]  # every range given back
        s = (await client.stats())[node.address]
        assert (s.blocks_held, s.bytes_in, s.bytes_out) == (5, 5 * 200_000, 2 * 200_000)
        # a block larger than any this client has seen: the shared get's reservation is too small,
        # so that get goes through gRPC messages and teaches the client the larger size
        other = GrpcKVStoreClient([node.address])
        big = blocks(1, 500_000)
        await other.put(big)
        await other.close()
        assert await client.get([big[0].hash, bs[1].hash]) == [big[0], bs[1]]
        assert client._block_bytes == 500_000
        # an arena too small for a call: gRPC messages carry that one
        small = GrpcKVStoreClient([node.address], shared_memory_bytes=64 << 10)
        assert await small.put(blocks(2, 100_000)) == 2
        await small.close()
    finally:
        await client.close()


async def test_blocks_already_in_a_segment_are_named_not_copied(node):
    """An engine process's exported pages lie in its exports segment: the put names that segment
    and their offsets, and the client's own arena is not used."""
    exports = ShmArena.create(1 << 20)
    client = GrpcKVStoreClient([node.address], shared_memory_bytes=1 << 20)
    bs = blocks(3, 100_000)
    try:
        for i in range(3):  # laid out at 4096, 104096, 204096
            at = 4096 + i * 100_000
            exports.view(at, 100_000)[:] = bs[i].data
            bs[i].data, bs[i].shared = exports.view(at, 100_000), (exports.name, at)
        assert await client.put(bs) == 3
        assert list(node._servicer.segments._open) == [exports.name]  # not the client's arena
        got = await client.get([b.hash for b in bs])
        assert [g.data for g in got] == [bytes(x.data) for x in bs]
    finally:
        await client.close()
        bs.clear()  # their views, before the segment closes
        exports.close()


async def test_a_get_into_a_given_range_leaves_the_blocks_there(node):
    """A get `into` a range of another segment (an engine's imports segment): the blocks land there
    back to back, missing ones take no room, each block's data views its spot and `shared` names
    it; the client's own arena is not used. A range too small: the blocks come as messages."""
    imports = ShmArena.create(1 << 20)
    client = GrpcKVStoreClient([node.address], shared_memory_bytes=1 << 20)
    bs = blocks(3, 100_000)
    got, ranges = [], []
    try:
        assert await client.put(bs) == 3
        arena_before = list(client._arena._free)
        start = imports.alloc(4 * 100_000)
        into = SegmentRange(imports.name, start, 4 * 100_000, imports.view(start, 4 * 100_000))
        ranges.append(into)
        missing = os.urandom(32)
        got = await client.get([bs[2].hash, missing, bs[0].hash], lease_holder="d", lease_seconds=5, into=into)
        assert got[1] is None
        assert [(g.shared, isinstance(g.data, memoryview)) for g in (got[0], got[2])] == \
            [((imports.name, start), True), ((imports.name, start + 100_000), True)]
        assert bytes(imports.view(start, 200_000)) == bs[2].data + bs[0].data
        assert got[0] == bs[2] and got[2] == bs[0]
        assert client._arena._free == arena_before and node._servicer.segments._open.keys() == {
            client._arena.name, imports.name}
        small = SegmentRange(imports.name, start, 150_000, imports.view(start, 150_000))
        ranges.append(small)
        again = await client.get([bs[1].hash, bs[2].hash], into=small)  # two blocks do not fit
        assert again == [bs[1], bs[2]] and all(g.shared is None for g in again)
        with pytest.raises(ValueError, match="outside the range"):
            into.view(start + 300_000, 200_000)
        del into, small
    finally:
        await client.close()
        got.clear()  # their views, before the segment closes
        ranges.clear()
        imports.close()


async def test_a_node_that_cannot_open_the_segment_gets_messages(node):
    """Another host's kvstore cannot see this host's /dev/shm: here the file is gone, the mapping
    stays. The first call falls back, and the node is not asked again."""
    client = GrpcKVStoreClient([node.address], shared_memory_bytes=1 << 20)
    try:
        os.unlink(f"/dev/shm/{client._arena.name}")
        bs = blocks(3, 50_000)
        assert await client.put(bs) == 3
        assert client._no_shm == {node.address}
        assert await client.get([b.hash for b in bs]) == bs
    finally:
        await client.close()  # its unlink finds the segment gone, and says nothing


async def test_server_checks_names_ranges_and_checksums(node):
    arena = ShmArena.create(1 << 16)
    try:
        data = os.urandom(1000)
        arena.view(0, 1000)[:] = data
        header = pb.BlockHeader(hash=os.urandom(32), size=1000, crc32=zlib.crc32(data), layout="L",
                                token_ids=list(range(16)))
        async with grpc.aio.insecure_channel(node.address, options=GRPC_OPTIONS) as ch:
            stub = pb_grpc.KVStoreStub(ch)
            cases = [("not-kvmesh", 0, header, grpc.StatusCode.INVALID_ARGUMENT),
                     (arena.name, (1 << 16) - 10, header, grpc.StatusCode.INVALID_ARGUMENT),
                     ("kvmesh-no-such-segment", 0, header, grpc.StatusCode.FAILED_PRECONDITION)]
            bad_crc = pb.BlockHeader()
            bad_crc.CopyFrom(header)
            bad_crc.crc32 ^= 1
            cases.append((arena.name, 0, bad_crc, grpc.StatusCode.DATA_LOSS))
            for segment, offset, h, code in cases:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.PutShared(pb.SharedPut(segment=segment, blocks=[pb.SharedBlock(header=h, offset=offset)]),
                                         timeout=RPC_TIMEOUT)
                assert err.value.code() == code, (segment, offset)
            reply = await stub.PutShared(pb.SharedPut(segment=arena.name, blocks=[pb.SharedBlock(header=header)]),
                                         timeout=RPC_TIMEOUT)
            assert reply.stored == 1
            req = pb.GetRequest(hashes=[header.hash])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetShared(pb.SharedGet(request=req, segment=arena.name, offset=4096, capacity=999),
                                     timeout=RPC_TIMEOUT)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            got = await stub.GetShared(pb.SharedGet(request=req, segment=arena.name, offset=4096, capacity=1000),
                                       timeout=RPC_TIMEOUT)
            assert [(b.offset, b.header.size) for b in got.blocks] == [(4096, 1000)]
            assert bytes(arena.view(4096, 1000)) == data
    finally:
        node._servicer.segments.close()  # the server's mapping, before the segment goes
        arena.close()


async def test_a_gone_clients_segment_is_closed_when_a_new_one_opens(node):
    first = GrpcKVStoreClient([node.address], shared_memory_bytes=1 << 20)
    assert await first.put(blocks(1, 10_000)) == 1
    name = first._arena.name
    assert list(node._servicer.segments._open) == [name]
    await first.close()  # a worker that stopped (or restarted): its segment is unlinked
    second = GrpcKVStoreClient([node.address], shared_memory_bytes=1 << 20)
    try:
        assert await second.put(blocks(1, 10_000)) == 1
        assert list(node._servicer.segments._open) == [second._arena.name]  # the old mapping went
    finally:
        await second.close()
