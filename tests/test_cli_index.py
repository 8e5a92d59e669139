"""`kvmesh index` (one MemoryIndex over HTTP, RemoteIndex client), `kvmesh health`, signals stop a service."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.cli import main
from kvmesh.index import MemoryIndex, make_index
from kvmesh.launcher import free_port, probe
from kvmesh.remote_index import RemoteIndex, make_index_app


def _rand_hashes(n: int) -> list[bytes]:
    return [random.randbytes(32) for _ in range(n)]


async def test_remote_index_matches_memory_index():
    runner = web.AppRunner(make_index_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    remote, local = make_index(url), MemoryIndex()
    assert isinstance(remote, RemoteIndex)
    try:
        hashes = _rand_hashes(64)
        holders = [f"127.0.0.1:{p}" for p in random.sample(range(1024, 65535), 3)]
        for _ in range(30):  # the same random publish sequence into both
            holder = random.choice(holders)
            stored, removed = random.sample(hashes, 8), random.sample(hashes, 3)
            await remote.publish(holder, stored, removed)
            await local.publish(holder, stored, removed)
        probe_hashes = hashes + _rand_hashes(5)
        assert await remote.lookup(probe_hashes) == await local.lookup(probe_hashes)
        assert any(await remote.lookup(hashes))
        await remote.drop_holder(holders[0])
        await local.drop_holder(holders[0])
        got = await remote.lookup(probe_hashes)
        assert got == await local.lookup(probe_hashes) and all(holders[0] not in h for h in got)
        assert await remote.lookup([]) == []
        second = RemoteIndex(url)  # another process's client sees the same index
        assert await second.lookup(probe_hashes) == got
        await second.close()
    finally:
        await remote.close()
        await runner.cleanup()


async def test_remote_index_errors():
    with pytest.raises(ValueError, match="--redis-url"):
        RemoteIndex("redis://x:1")
    with pytest.raises(ValueError, match="--redis-url"):
        make_index("tcp://x:1")
    runner = web.AppRunner(make_index_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    idx = RemoteIndex(url)
    try:
        with pytest.raises(RuntimeError, match="400"):
            await idx._call("/publish", {"holder": "a:1"})  # stored/removed missing
    finally:
        await idx.close()
        await runner.cleanup()


@pytest.fixture
def grpc_health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_health_probe_grpc(grpc_health_server, capsys):
    servicer, addr = grpc_health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert probe(addr) == (True, "SERVING")
    assert main(["health", addr], environ={}) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert probe(addr) == (False, "NOT_SERVING")
    assert main(["health", addr], environ={}) == 1
    ok, detail = probe(f"127.0.0.1:{free_port()}", 0.5)
    assert not ok and detail.startswith("gRPC ")
    assert "NOT_SERVING" in capsys.readouterr().out


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe(url, 0.5)[0]:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "index did not become healthy"
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_index_process_serves_and_stops_on_signal(sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "KVMESH_PORT": str(port)}  # the port comes from the environment
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh", "index", "--host", "127.0.0.1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(url, proc)
        assert main(["health", url], environ={}) == 0
        proc.send_signal(sig)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not probe(url, 0.5)[0]
