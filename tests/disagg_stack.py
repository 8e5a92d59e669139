"""The disaggregated stack the serving tests play the gateway against, in this process: one kvstore
node, one prefill worker, decode workers (the second started on first use), the single-process
reference, one shared in-memory index; real gRPC on loopback, SmolLM2 in every engine. The
`stack` fixture is module-scoped, once for fp32 KV and once for fp8.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.decode.config import DecodeConfig
from kvmesh.decode.server import DecodeWorker
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.hashing import block_hashes
from kvmesh.index import MemoryIndex
from kvmesh.kvstore.client import GrpcKVStoreClient
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.server import KVStoreServer
from kvmesh.prefill.config import PrefillConfig
from kvmesh.prefill.server import PrefillWorker
from kvmesh.wire import convert
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc


BS = 16
KV_MEMORY = 32 << 20  # per engine: ~45 fp32 pages of SmolLM2 (30 layers x 3 heads x 64)
MAX_MODEL_LEN = 256


def _engine_config(kv_dtype: str) -> EngineConfig:
    return EngineConfig(model="smollm2", device="cpu",
                        cache=CacheConfig(block_size=BS, kv_cache_dtype=kv_dtype, kv_cache_memory=KV_MEMORY),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=MAX_MODEL_LEN))


@dataclass
class Stack:
    """One kvstore node, one prefill worker, decode workers (the second started on first use), the
    single-process reference, one shared in-memory index. Every engine loads SmolLM2 (~7 s each)."""

    kv_dtype: str
    index: MemoryIndex
    kvstore: KVStoreServer
    reference: LLM
    spans: InMemorySpanExporter
    workers: list = dataclasses.field(default_factory=list)  # prefill, decode 0, decode 1
    channels: list = dataclasses.field(default_factory=list)
    clients: list = dataclasses.field(default_factory=list)

    async def add_worker(self, cls, cfg_cls, **extra):
        common = dict(engine=_engine_config(self.kv_dtype), kvstore=(self.kvstore.address,), port=0,
                      publish_interval=0.01)
        cfg = cfg_cls(**common, **extra)
        engine = AsyncEngine(await asyncio.to_thread(LLMEngine, cfg.engine))
        client = GrpcKVStoreClient([self.kvstore.address], shared_memory_bytes=cfg.kvstore_shared_memory_mib << 20,
                                   block_bytes=engine.info.layout.block_bytes)  # as serve_worker builds it
        self.clients.append(client)
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        w = cls(cfg, engine, client, self.index, tracer=provider.get_tracer("test"))
        await w.start()
        self.workers.append(w)
        self.channels.append(grpc.aio.insecure_channel(w.address))

    @property
    def prefill(self) -> PrefillWorker:
        return self.workers[0]

    async def decode(self, i: int) -> DecodeWorker:
        while len(self.workers) < 2 + i:
            await self.add_worker(DecodeWorker, DecodeConfig, metrics_port=0)
        return self.workers[1 + i]

    def prefill_stub(self) -> pb_grpc.PrefillStub:
        return pb_grpc.PrefillStub(self.channels[0])

    async def decode_stub(self, i: int) -> pb_grpc.DecodeStub:
        await self.decode(i)
        return pb_grpc.DecodeStub(self.channels[1 + i])

    def hashes(self, prompt: list[int]) -> list[bytes]:
        return block_hashes(prompt, self.reference.llm_engine.hash_context())

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
        for w in self.workers:
            await w.stop(grace=0.5)
        for c in self.clients:
            await c.close()
        await self.kvstore.stop(grace=0.5)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["auto", "fp8"])
async def stack(request):
    torch.set_num_threads(2)
    kv_dtype = request.param
    index = MemoryIndex()
    kvstore = KVStoreServer(KVStoreConfig(port=0, capacity_bytes=256 << 20, publish_interval=0.01), index=index)
    await kvstore.start()
    reference = await asyncio.to_thread(LLM, "smollm2", device="cpu", kv_cache_dtype=kv_dtype,
                                        block_size=BS, kv_cache_memory=KV_MEMORY, max_num_seqs=4,
                                        max_model_len=MAX_MODEL_LEN)
    s = Stack(kv_dtype, index, kvstore, reference, InMemorySpanExporter())
    try:
        await s.add_worker(PrefillWorker, PrefillConfig)
        await s.decode(0)
        yield s
    finally:
        await s.close()


def random_prompt(n: int) -> list[int]:
    rng = random.Random()
    return [rng.randrange(100, 49000) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def disaggregated(stack: Stack, prompt: list[int], params: SamplingParams, decode: int = 0,
                  cached: list[bytes] = ()) -> tuple[list[int], str, pb.PrefillReply, list[pb.GenerateChunk]]:
    """Prefill hop then a decode stream, as the gateway does it."""
    sampling = convert.sampling_to_proto(params)
    refs = [pb.BlockRef(hash=h, node=stack.kvstore.address) for h in cached]
    reply = await stack.prefill_stub().Prefill(pb.PrefillRequest(
        request_id=f"t-{random.random()}", prompt_token_ids=prompt, sampling=sampling, cached_blocks=refs))
    chunks = [c async for c in (await stack.decode_stub(decode)).Generate(pb.GenerateRequest(
        request_id=f"t-{random.random()}", prompt_token_ids=prompt, sampling=sampling, prefilled=reply))]
    tokens = [reply.first_token] + [t for c in chunks for t in c.token_ids]
    text = reply.first_text + "".join(c.text for c in chunks)
    return tokens, text, reply, chunks
