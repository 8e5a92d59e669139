"""Cross-gateway load: two gateways share decode workers; each polls the workers' Load RPC, so the
requests one gateway keeps running count for the other, which routes around them (no herding)."""
from __future__ import annotations

import asyncio

import aiohttp
import grpc
import torch

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.decode.config import DecodeConfig
from kvmesh.decode.server import DecodeWorker
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.gateway.app import GATEWAY, start
from kvmesh.gateway.config import GatewayConfig
from kvmesh.index import MemoryIndex
from kvmesh.kvstore.client import GrpcKVStoreClient
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.server import KVStoreServer
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc
from test_engine_models import make_tiny_model

torch.set_num_threads(1)
LONG = 440  # tokens each of gateway A's requests generates: it keeps worker 1 busy meanwhile


async def _until(cond, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


async def test_second_gateway_routes_around_load_it_did_not_send(tmp_path):
    make_tiny_model(tmp_path, "llama", seed=13)
    model = str(tmp_path)
    index = MemoryIndex()
    kvstore = KVStoreServer(KVStoreConfig(port=0, capacity_bytes=16 << 20, publish_interval=0.01), index=index)
    await kvstore.start()
    ecfg = EngineConfig(model=model, device="cpu", cache=CacheConfig(kv_cache_memory=4 << 20),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=512))
    kvs, workers = [], []
    for _ in range(2):
        kv = GrpcKVStoreClient([kvstore.address])
        w = DecodeWorker(DecodeConfig(engine=ecfg, kvstore=(kvstore.address,), port=0, publish_interval=0.01),
                         AsyncEngine(await asyncio.to_thread(LLMEngine, ecfg)), kv, index)
        await w.start()
        kvs.append(kv)
        workers.append(w)
    w1, w2 = workers
    common = dict(model=model, max_model_len=512, port=0, health_interval_s=0.05)
    # A reaches only worker 1; B shares worker 1 and has worker 2 too.
    runner_a, port_a = await start(GatewayConfig(decode=(w1.address,), **common), index=index)
    runner_b, port_b = await start(GatewayConfig(decode=(w1.address, w2.address), **common), index=index)
    router_b = runner_b.app[GATEWAY].router
    long_calls = []
    try:
        async with aiohttp.ClientSession() as s:
            async def post(port: int, max_tokens: int) -> dict:
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={
                        "model": model, "prompt": "load test", "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True}) as r:
                    body = await r.json()
                    assert r.status == 200, body
                    return body

            # The Load RPC itself, as a gateway sees it.
            async with grpc.aio.insecure_channel(w1.address) as ch:
                idle = await pb_grpc.DecodeStub(ch).Load(pb.LoadRequest(), timeout=5)
            assert (idle.running, idle.waiting, idle.pending) == (0, 0, 0)

            long_calls = [asyncio.create_task(post(port_a, LONG)) for _ in range(3)]
            await _until(lambda: router_b.workers[w1.address].reported_load >= 3 or any(t.done() for t in long_calls),
                         20.0, "gateway B never saw worker 1's load")
            for t in long_calls:
                if t.done():
                    t.result()  # a long call that failed says why
            assert router_b.workers[w1.address].reported_load >= 3, "worker 1 went idle before B saw its load"
            assert router_b.workers[w1.address].in_flight == 0  # none of it is B's own
            before = (await w2.runtime.engine.run(lambda e: e.stats())).prompt_tokens
            shorts = [await post(port_b, 2) for _ in range(6)]
            assert not any(t.done() for t in long_calls), "worker 1 went idle before B finished"
            after = (await w2.runtime.engine.run(lambda e: e.stats())).prompt_tokens
            # every one of B's requests went to worker 2, none to the busy worker 1
            assert after - before == sum(b["usage"]["prompt_tokens"] for b in shorts)
            for b in await asyncio.gather(*long_calls):
                assert b["usage"]["completion_tokens"] == LONG
            await _until(lambda: router_b.workers[w1.address].reported_load == 0, 20.0,
                         "worker 1's reported load never went back to 0")
    finally:
        for t in long_calls:
            t.cancel()
        await runner_a.cleanup()
        await runner_b.cleanup()
        for w in workers:
            await w.stop(grace=0.5)
        for kv in kvs:
            await kv.close()
        await kvstore.stop(grace=0.5)
