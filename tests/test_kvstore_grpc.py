"""kvstore over real gRPC on loopback: round trips, missing blocks, leases, two nodes, index, health."""
from __future__ import annotations

import asyncio
import os
import random
import zlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.index import MemoryIndex, RedisIndex
from kvmesh.kvstore.chunks import GRPC_OPTIONS
from kvmesh.kvstore.client import (GrpcKVStoreClient, KVStoreUnavailable, LocalKVStoreClient, StoredBlock,
                                   node_for)
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.server import KVStoreServer
from kvmesh.kvstore.store import BlockStore
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc
from loop_gaps import LoopGaps

MiB = 1 << 20
RPC_TIMEOUT = 10.0  # every raw stub call here has a deadline: a stuck server fails the test instead


def rand_blocks(n: int, size: int = MiB) -> list[StoredBlock]:
    return [StoredBlock(os.urandom(32), [random.randrange(49152) for _ in range(16)], os.urandom(size), "smollm2/fp8/16")
            for _ in range(n)]


def cfg(**kw) -> KVStoreConfig:
    kw.setdefault("host", "127.0.0.1")
    kw.setdefault("port", 0)
    kw.setdefault("capacity_bytes", 16 * MiB)
    kw.setdefault("device", "cpu")
    kw.setdefault("publish_interval", 0.02)
    return KVStoreConfig(**kw)


@pytest.fixture
async def node():
    server = KVStoreServer(cfg(chunk_bytes=256 * 1024))  # 1 MiB blocks travel as 4 chunks
    await server.start()
    yield server
    await server.stop(grace=0.5)


async def test_put_get_round_trip_1mib_blocks(node):
    client = GrpcKVStoreClient([node.address])
    try:
        bs = rand_blocks(6)
        assert await client.put(bs) == 6
        assert await client.put(bs[:2]) == 2  # already held still counts as held
        missing = os.urandom(32)
        got = await client.get([bs[3].hash, missing, bs[0].hash, bs[5].hash])
        assert got[1] is None
        for g, want in zip([got[0], got[2], got[3]], [bs[3], bs[0], bs[5]]):
            assert g == want and zlib.crc32(g.data) == zlib.crc32(want.data)
        assert await client.contains([bs[1].hash, missing]) == [True, False]
        s = (await client.stats())[node.address]
        assert (s.blocks_held, s.capacity_blocks, s.bytes_in, s.bytes_out) == (6, 16, 6 * MiB, 3 * MiB)
    finally:
        await client.close()


async def test_concurrent_streams(node):
    client = GrpcKVStoreClient([node.address])
    try:
        groups = [rand_blocks(3, 300_000) for _ in range(4)]
        assert await asyncio.gather(*(client.put(g) for g in groups)) == [3] * 4
        got = await asyncio.gather(*(client.get([b.hash for b in g]) for g in groups))
        assert got == groups
    finally:
        await client.close()


async def test_bad_checksum_and_malformed_stream_rejected(node):
    async with grpc.aio.insecure_channel(node.address, options=GRPC_OPTIONS) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        data = os.urandom(5000)
        bad = pb.BlockChunk(header=pb.BlockHeader(hash=os.urandom(32), size=5000, crc32=zlib.crc32(data) ^ 7),
                            data=data)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Put(iter([bad]), timeout=RPC_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "crc32" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Put(iter([pb.BlockChunk(data=b"xx")]), timeout=RPC_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        short = pb.BlockChunk(header=pb.BlockHeader(hash=os.urandom(32), size=10, crc32=0), data=b"abc")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Put(iter([short]), timeout=RPC_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ended inside" in err.value.details()
        assert (await stub.Stats(pb.StatsRequest(), timeout=RPC_TIMEOUT)).blocks_held == 0


async def test_batched_rpcs_speak_protobuf_and_the_old_rpcs_still_work(node):
    """PutBatched / GetBatched (what GrpcKVStoreClient uses) with the generated stub's own protobuf
    objects, blocks put one way read back the other, and a malformed batch is refused."""
    client = GrpcKVStoreClient([node.address])
    async with grpc.aio.insecure_channel(node.address, options=GRPC_OPTIONS) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        mine, theirs = rand_blocks(3, 300_000), rand_blocks(2, 5000)
        assert await client.put(mine) == 3
        batch = pb.ChunkBatch(chunks=[pb.BlockChunk(header=pb.BlockHeader(
            hash=b.hash, size=len(b.data), crc32=zlib.crc32(b.data), layout=b.layout, token_ids=b.token_ids),
            data=b.data) for b in theirs])
        reply = await stub.PutBatched(iter([batch]), timeout=RPC_TIMEOUT)
        assert (reply.stored, reply.already_held) == (2, 0)
        assert await client.get([b.hash for b in theirs]) == theirs
        want = [mine[2].hash, os.urandom(32), mine[0].hash]
        chunks = [c async for m in stub.GetBatched(pb.GetRequest(hashes=want), timeout=RPC_TIMEOUT) for c in m.chunks]
        heads = [c.header for c in chunks if c.HasField("header")]
        assert [h.hash for h in heads] == want and [h.missing for h in heads] == [False, True, False]
        assert len(chunks) == 5  # 300 KB blocks in 256 KiB chunks: two each, several to a message
        assert b"".join(c.data for c in chunks) == mine[2].data + mine[0].data
        old = [c async for c in stub.Get(pb.GetRequest(hashes=[theirs[0].hash]), timeout=RPC_TIMEOUT)]
        assert [c.data for c in old] == [theirs[0].data]
        bad = pb.ChunkBatch(chunks=[pb.BlockChunk(data=b"xx")])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PutBatched(iter([bad]), timeout=RPC_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await client.close()


async def test_leases_over_grpc_block_eviction_then_expire():
    server = KVStoreServer(cfg(capacity_blocks=4, block_bytes=64 * 1024, high_watermark=1.0, low_watermark=0.5))
    await server.start()
    client = GrpcKVStoreClient([server.address])
    try:
        bs = rand_blocks(7, 64 * 1024)
        await client.put(bs[:4])
        got = await client.get([bs[0].hash, bs[1].hash], lease_holder="decode-a", lease_seconds=0.6)
        assert got == bs[:2]
        # Contains of a, b never renews their leases
        assert await client.contains([bs[0].hash]) == [True]
        await client.put(bs[4:5])  # needs room: c, d (unleased) go although a, b are older
        assert await client.contains([b.hash for b in bs[:5]]) == [True, True, False, False, True]
        await asyncio.sleep(0.7)
        for _ in range(3):
            assert await client.contains([bs[0].hash]) == [True]
        await client.put(bs[5:7])  # leases expired: a, b are evictable again
        assert await client.contains([b.hash for b in bs]) == [False, False, False, False, True, True, True]
        # release drops a lease at once
        await client.get([bs[5].hash], lease_holder="x", lease_seconds=30)
        assert (await client.stats())[server.address].blocks_leased == 1
        await client.release([bs[5].hash], "x")
        assert (await client.stats())[server.address].blocks_leased == 0
    finally:
        await client.close()
        await server.stop(grace=0.5)


async def test_two_nodes_shard_and_get_across(redis_flush):
    index = RedisIndex(redis_flush)
    servers = [KVStoreServer(cfg(), index=index) for _ in range(2)]
    for s in servers:
        await s.start()
    addrs = [s.address for s in servers]
    client = GrpcKVStoreClient(addrs)
    try:
        bs = rand_blocks(12, 200_000)
        while len({node_for(b.hash, addrs) for b in bs}) < 2:  # both nodes own some (1 draw in 2,048 fails)
            bs = rand_blocks(12, 200_000)
        assert await client.put(bs) == 12
        owners = [node_for(b.hash, addrs) for b in bs]
        for s in servers:
            held = set(s.store.held_hashes())
            assert held == {b.hash for b, o in zip(bs, owners) if o == s.address}
        assert await client.get([b.hash for b in bs]) == bs
        for s in servers:
            await s.publisher.flush()
        assert await index.lookup([b.hash for b in bs]) == [frozenset({o}) for o in owners]
        # a node goes away: new puts go to the survivor; its blocks read as missing, not as errors
        await servers[1].stop(grace=0.1)
        assert await index.lookup([b.hash for b in bs]) == [
            frozenset({o}) if o == addrs[0] else frozenset() for o in owners]
        more = rand_blocks(4, 1000)
        assert await client.put(more) == 4
        assert all(servers[0].store.contains([b.hash for b in more]))
        got = await client.get([b.hash for b in bs])
        assert got == [b if o == addrs[0] else None for b, o in zip(bs, owners)]
    finally:
        await client.close()
        for s in servers:
            await s.stop(grace=0.1)
        await index.close()


async def test_publishes_to_index_and_stale_entries_cost_a_miss():
    index = MemoryIndex()
    server = KVStoreServer(cfg(capacity_blocks=2, block_bytes=4096, high_watermark=1.0, low_watermark=0.5),
                           index=index)
    await server.start()
    client = GrpcKVStoreClient([server.address])
    try:
        bs = rand_blocks(3, 4096)
        await client.put(bs[:2])
        await asyncio.sleep(0.1)  # the publisher's batch interval is 20 ms
        assert await index.lookup([b.hash for b in bs]) == [frozenset({server.address})] * 2 + [frozenset()]
        await client.put(bs[2:])  # evicts a
        stale = await index.lookup([bs[0].hash])
        assert stale == [frozenset({server.address})] or stale == [frozenset()]
        assert await client.get([bs[0].hash]) == [None]  # a stale entry only costs a miss
        await server.publisher.flush()
        assert await index.lookup([b.hash for b in bs]) == [frozenset(), frozenset({server.address}),
                                                            frozenset({server.address})]
    finally:
        await client.close()
        await server.stop(grace=0.1)
    assert await index.lookup([b.hash for b in bs]) == [frozenset()] * 3  # withdrawn on stop


async def test_health_and_graceful_stop(node):
    async with grpc.aio.insecure_channel(node.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "kvmesh.v1.KVStore"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await node.stop(grace=0.1)
    client = GrpcKVStoreClient([node.address], timeout=2.0)
    try:
        with pytest.raises(ConnectionError, match="no kvstore node"):
            await client.put(rand_blocks(1, 100))
    finally:
        await client.close()


async def test_the_first_puts_slab_is_allocated_off_the_event_loop():
    """The first put sizes the slabs; touching a 1 GiB host slab's pages takes seconds, and the
    server's event loop (its health checks, everyone's gets) must go on meanwhile."""
    node = KVStoreServer(cfg(capacity_bytes=1 << 30))
    await node.start()
    client = GrpcKVStoreClient([node.address])
    try:
        async with LoopGaps() as loop:
            assert await client.put(rand_blocks(2, 100_000)) == 2
    finally:
        await client.close()
        await node.stop(grace=0.1)
    # 0.15 s on an idle build machine, 2.5-4 s while it is loaded: long enough either way for a
    # stalled loop to show as one gap of most of the put
    assert loop.seconds > 0.1, loop.seconds
    assert loop.longest < loop.seconds / 2, (loop.longest, loop.seconds)  # the loop ran on through it


async def test_local_client_same_interface():
    store = BlockStore(cfg(capacity_blocks=3, block_bytes=MiB))
    client = LocalKVStoreClient(store)
    bs = rand_blocks(2)
    assert await client.put(bs) == 2
    assert await client.get([bs[1].hash, os.urandom(32)], "w", 5.0) == [bs[1], None]
    assert await client.contains([bs[0].hash]) == [True]
    assert store.stats().blocks_leased == 1
    await client.release([bs[1].hash], "w")
    assert store.stats().blocks_leased == 0
    await client.close()


def test_node_for_is_rendezvous():
    nodes = [f"10.0.0.{i}:50061" for i in range(5)]
    hs = [os.urandom(32) for _ in range(400)]
    owners = [node_for(h, nodes) for h in hs]
    assert owners == [node_for(h, list(reversed(nodes))) for h in hs]  # order-independent
    counts = {n: owners.count(n) for n in nodes}
    assert min(counts.values()) > 40  # roughly even: 80 expected per node
    # removing a node moves only its own blocks
    survivors = nodes[:2] + nodes[3:]
    assert all(node_for(h, survivors) == o for h, o in zip(hs, owners) if o != nodes[2])


async def test_node_process_serves_publishes_and_stops_on_sigterm(redis_flush):
    import signal
    import subprocess
    import sys
    import time

    from redis_server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.kvstore", "--port", str(port), "--device", "cpu",
                             "--capacity-bytes", str(8 * MiB), "--redis-url", redis_flush,
                             "--publish-interval", "0.02"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    index = RedisIndex(redis_flush)
    client = GrpcKVStoreClient([address], timeout=5.0)
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 30
            while True:
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.KVStore"), timeout=1)
                    break
                except grpc.aio.AioRpcError:
                    assert time.monotonic() < deadline and proc.poll() is None, "kvstore did not start"
                    await asyncio.sleep(0.1)
        bs = rand_blocks(3, 100_000)
        assert await client.put(bs) == 3
        for _ in range(100):
            if await index.lookup([b.hash for b in bs]) == [frozenset({address})] * 3:
                break
            await asyncio.sleep(0.02)
        assert await index.lookup([b.hash for b in bs]) == [frozenset({address})] * 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0
        assert await index.lookup([b.hash for b in bs]) == [frozenset()] * 3  # withdrawn on the way out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await client.close()
        await index.close()


async def test_prometheus_metrics():
    import aiohttp

    server = KVStoreServer(cfg(metrics_port=0))
    await server.start()
    client = GrpcKVStoreClient([server.address])
    try:
        bs = rand_blocks(3, 50_000)
        await client.put(bs)
        await client.get([bs[0].hash])
        server.update_metrics()
        url = f"http://127.0.0.1:{server.metrics_server.port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            text = await resp.text()
        values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                  if line.startswith("kvmesh:store_") and " " in line}
        assert values["kvmesh:store_blocks_held"] == 3
        assert values["kvmesh:store_bytes_in_total"] == 150_000
        assert values["kvmesh:store_bytes_out_total"] == 50_000
        assert values['kvmesh:store_transfer_seconds_count{op="put"}'] == 1
        assert values['kvmesh:store_transfer_seconds_count{op="get"}'] == 1
    finally:
        await client.close()
        await server.stop(grace=0.1)


async def test_a_first_put_cut_off_by_its_deadline_leaves_one_allocation(monkeypatch):
    """The slabs are allocated once, however many first puts wait for them: a put whose deadline
    ended during the allocation (seconds on a loaded machine) let the next put start another,
    whose slab then replaced the one blocks had been stored in (three allocations seen under
    py-spy, in a served burst)."""
    import time
    calls = []
    allocate = BlockStore.allocate

    def slow_allocate(store, slot_bytes):
        calls.append(slot_bytes)
        time.sleep(1.0)  # a loaded machine touching a big slab
        allocate(store, slot_bytes)
    monkeypatch.setattr(BlockStore, "allocate", slow_allocate)
    node = KVStoreServer(cfg(capacity_bytes=16 * MiB))
    await node.start()
    impatient = GrpcKVStoreClient([node.address], timeout=0.3)
    client = GrpcKVStoreClient([node.address])
    try:
        with pytest.raises(KVStoreUnavailable):  # its deadline ends first
            await impatient.put(rand_blocks(1, 100_000))
        kept = rand_blocks(2, 100_000)
        assert await client.put(kept) == 2
        await asyncio.sleep(1.5)  # any second allocation would be done by now
        assert await client.put(rand_blocks(2, 100_000)) == 2
        assert [b is not None for b in await client.get([b.hash for b in kept])] == [True, True]
        assert calls == [100_000]
    finally:
        await impatient.close()
        await client.close()
        await node.stop(grace=0.1)
