"""Worker shutdown: cancelling serve() (what SIGTERM does through kvmesh.cli) runs the whole teardown:
the holder leaves the prefix index, the engine (its process, or its thread) ends, the index client closes."""
from __future__ import annotations

import asyncio
import multiprocessing
import socket
import threading

import grpc
import pytest
import torch
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.config import CacheConfig, EngineConfig
from kvmesh.decode import server as decode_server
from kvmesh.decode.config import DecodeConfig
from kvmesh.index import MemoryIndex
from kvmesh.prefill import server as prefill_server
from kvmesh.prefill.config import PrefillConfig
from kvmesh.remote_index import make_index_app
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc
from cancel_swallowing_index import CancelSwallowingIndex
from test_engine_models import make_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(d, "llama", seed=5)
    return str(d)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engines() -> int:
    """Engines running for this process: threads (--no-engine-process) and child processes."""
    return (sum(t.name == "kvmesh-engine" and t.is_alive() for t in threading.enumerate())
            + sum(p.name == "kvmesh-engine-core" for p in multiprocessing.active_children()))


async def _until_serving(port: int, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if loop.time() > end:
                raise TimeoutError(f"worker on {port} never became SERVING")
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("role,engine_process", [("prefill", True), ("decode", True), ("decode", False)])
async def test_cancelled_serve_drops_holder_and_stops_engine(model_dir, role, engine_process):
    index = MemoryIndex()  # behind a real `kvmesh index` HTTP app: serve() builds its own client
    runner = web.AppRunner(make_index_app(index), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    index_port = runner.addresses[0][1]
    port = _free_port()
    holder = f"127.0.0.1:{port}"
    cfg_cls, serve = {"prefill": (PrefillConfig, prefill_server.serve),
                      "decode": (DecodeConfig, decode_server.serve)}[role]
    cfg = cfg_cls(engine=EngineConfig(model=model_dir, device="cpu", cache=CacheConfig(kv_cache_memory=1 << 20)),
                  kvstore=("127.0.0.1:1",), port=port, redis_url=f"http://127.0.0.1:{index_port}",
                  publish_interval=0.01, engine_process=engine_process)
    before = _engines()
    task = asyncio.create_task(serve(cfg))
    try:
        await _until_serving(port)
        assert _engines() == before + 1
        async with grpc.aio.insecure_channel(holder) as ch:  # both roles answer the Load RPC
            stub = (pb_grpc.PrefillStub if role == "prefill" else pb_grpc.DecodeStub)(ch)
            load = await stub.Load(pb.LoadRequest(), timeout=5)
        assert (load.running, load.waiting, load.pending, load.kv_cache_usage) == (0, 0, 0, 0.0)
        h = bytes(range(32))
        await index.publish(holder, [h], [])  # as if the worker had published a cached block
        assert await index.lookup([h]) == [frozenset({holder})]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await index.lookup([h]) == [frozenset()]
        assert _engines() == before
    finally:
        task.cancel()
        await runner.cleanup()


def test_kvstore_module_exits_promptly_on_sigint_even_if_inherited_ignored():
    """`python -m kvmesh.kvstore &` from a script starts with SIGINT ignored; Python then installs no
    KeyboardInterrupt handler, so SIGINT did nothing until the sender killed the node (5-12 s)."""
    import signal
    import subprocess
    import sys
    import time

    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "kvmesh.kvstore", "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        out = b""
        deadline = time.monotonic() + 60
        while b"serving on" not in out:
            chunk = p.stdout.read1(4096)
            assert chunk and time.monotonic() < deadline, f"kvstore never came up: {out[-500:]!r}"
            out += chunk
        t = time.monotonic()
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=5) == 0
        assert time.monotonic() - t < 5
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()


async def test_worker_stop_returns_although_the_index_swallowed_the_cancel(model_dir):
    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.worker_config import WorkerConfig
    from kvmesh.worker_runtime import WorkerRuntime

    cfg = WorkerConfig(engine=EngineConfig(model=model_dir, device="cpu", cache=CacheConfig(kv_cache_memory=1 << 20)),
                       kvstore=("127.0.0.1:1",), publish_interval=0.01)
    engine = AsyncEngine(await asyncio.to_thread(LLMEngine, cfg.engine))
    index = CancelSwallowingIndex()
    runtime = WorkerRuntime(cfg, "prefill", engine, index)
    await runtime.start()
    try:  # a 40-token prompt fills two blocks: their stored events make the loop publish
        async for _ in engine.generate("r", list(range(3, 43)), SamplingParams(max_tokens=1)):
            pass
        await asyncio.wait_for(index.in_publish.wait(), 30)
        stop = asyncio.create_task(runtime.stop(grace=0.1))
        done, _ = await asyncio.wait([stop], timeout=20)  # the old loop ran on and stop() hung
        assert done, "WorkerRuntime.stop() hung after the index swallowed the publisher's cancel"
        stop.result()
        assert index.swallowed == 1
    finally:
        if not runtime._stopped.is_set():
            await engine.stop()
