"""Gateway tracing: one HTTP request gives a gateway SERVER span and a worker span in the same trace,
at a real OTLP receiver (the gateway's gRPC calls carry `traceparent`)."""
from __future__ import annotations

import asyncio

import aiohttp
import torch

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.decode.config import DecodeConfig
from kvmesh.decode.server import DecodeWorker
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.gateway.app import start
from kvmesh.gateway.config import GatewayConfig
from kvmesh.index import MemoryIndex
from kvmesh.kvstore.client import GrpcKVStoreClient
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.server import KVStoreServer
from kvmesh.telemetry import setup_tracing
from test_engine_models import make_tiny_model
from test_telemetry import otlp_receiver  # noqa: F401  (a fixture: a real OTLP TraceService)

torch.set_num_threads(1)


async def test_request_spans_gateway_and_worker_in_one_trace(tmp_path, otlp_receiver):  # noqa: F811
    receiver, endpoint = otlp_receiver
    make_tiny_model(tmp_path, "llama", seed=9)
    model = str(tmp_path)
    gw_tracing = setup_tracing("kvmesh-gateway", endpoint, set_global=False)
    wk_tracing = setup_tracing("kvmesh-decode", endpoint, set_global=False)
    index = MemoryIndex()
    kvstore = KVStoreServer(KVStoreConfig(port=0, capacity_bytes=16 << 20, publish_interval=0.01), index=index)
    await kvstore.start()
    ecfg = EngineConfig(model=model, device="cpu", cache=CacheConfig(kv_cache_memory=1 << 20),
                        scheduler=SchedulerConfig(max_num_seqs=2, max_model_len=128))
    kv = GrpcKVStoreClient([kvstore.address])
    worker = DecodeWorker(DecodeConfig(engine=ecfg, kvstore=(kvstore.address,), port=0),
                          AsyncEngine(await asyncio.to_thread(LLMEngine, ecfg)), kv, index,
                          tracer=wk_tracing.tracer)
    await worker.start()
    cfg = GatewayConfig(model=model, decode=(worker.address,), max_model_len=128, port=0)
    runner, port = await start(cfg, index=index, health_checks=False, tracer=gw_tracing.tracer)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={
                    "model": model, "prompt": "hello there", "max_tokens": 3, "temperature": 0}) as r:
                body = await r.json()
                assert r.status == 200, body
        assert body["usage"]["completion_tokens"] >= 1
    finally:
        await runner.cleanup()
        await worker.stop(grace=0.5)
        await kv.close()
        await kvstore.stop(grace=0.5)
        gw_tracing.shutdown()  # flush before the receiver goes away
        wk_tracing.shutdown()
    gw = [sp for svc, sp in receiver.spans if svc == "kvmesh-gateway" and sp.name == "POST /v1/completions"]
    wk = [sp for svc, sp in receiver.spans if svc == "kvmesh-decode" and sp.name == "kvmesh.decode/Generate"]
    assert len(gw) == 1 and len(wk) == 1, [(svc, sp.name) for svc, sp in receiver.spans]
    assert wk[0].trace_id == gw[0].trace_id
    assert wk[0].parent_span_id == gw[0].span_id
    status = {a.key: a.value.int_value for a in gw[0].attributes}["http.response.status_code"]
    assert status == 200
