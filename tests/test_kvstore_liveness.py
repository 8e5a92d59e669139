"""A kvstore client's view of its nodes: a call's deadline grows with its bytes; a node that hangs
(accepts connections, answers nothing) costs the call in flight its deadline and the calls after it
nothing until it answers a health check; a node that comes back on its port takes calls again."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

import kvmesh.kvstore.client as client_module
from kvmesh.kvstore.client import CALL_BASE_S, MIN_BYTES_PER_S, GrpcKVStoreClient, KVStoreUnavailable, call_deadline
from kvmesh.kvstore.server import KVStoreServer
from test_kvstore_grpc import cfg, rand_blocks


def test_a_deadline_grows_with_the_bytes_up_to_the_ceiling():
    assert call_deadline(0, 30.0) == CALL_BASE_S
    assert call_deadline(int(MIN_BYTES_PER_S), 30.0) == CALL_BASE_S + 1
    assert call_deadline(1 << 40, 30.0) == 30.0


class Hung:
    """A listening socket that never answers: a stopped process, or a partition, as a client sees it."""

    def __enter__(self) -> str:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.sock.close()


async def test_a_hung_node_costs_one_deadline_then_calls_skip_it(monkeypatch):
    monkeypatch.setattr(client_module, "CALL_BASE_S", 0.5)
    with Hung() as address:
        client = GrpcKVStoreClient([address], probe_interval_s=0.1)
        try:
            t0 = time.monotonic()
            with pytest.raises(KVStoreUnavailable):
                await client.put(rand_blocks(2, 1000))
            assert 0.4 < time.monotonic() - t0 < 3.0  # its deadline, not the 30 s ceiling
            assert client.live_nodes() == []
            t0 = time.monotonic()
            with pytest.raises(KVStoreUnavailable):
                await client.get([b.hash for b in rand_blocks(2, 10)])
            assert time.monotonic() - t0 < 0.1  # skipped: no call went out
            await asyncio.sleep(0.5)
            assert client.live_nodes() == []  # health checks get no answer either
        finally:
            await client.close()


async def test_a_node_back_on_its_port_takes_calls_again_without_a_request_finding_out():
    first = KVStoreServer(cfg())
    await first.start()
    port = int(first.address.rsplit(":", 1)[1])
    client = GrpcKVStoreClient([first.address], probe_interval_s=0.1)
    try:
        await first.stop(grace=0.1)
        with pytest.raises(KVStoreUnavailable):
            await client.put(rand_blocks(1, 1000))
        assert client.live_nodes() == []
        second = KVStoreServer(cfg(port=port))
        await second.start()
        try:
            deadline = time.monotonic() + 10
            while not client.live_nodes():
                assert time.monotonic() < deadline, "the node never came back"
                await asyncio.sleep(0.05)
            blocks = rand_blocks(2, 1000)
            assert await client.put(blocks) == 2
            assert await client.get([b.hash for b in blocks]) == blocks
        finally:
            await second.stop(grace=0.1)
    finally:
        await client.close()
