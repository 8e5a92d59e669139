"""WorkerRuntime's prefix-cache events: a request's lookup of the local cache drains them without
a round trip to the index; the publish tick sends each hash's last state, and retries a failed one."""
from __future__ import annotations

import asyncio

import pytest
import torch

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.index import MemoryIndex
from kvmesh.worker_config import WorkerConfig
from kvmesh.worker_runtime import WorkerRuntime
from test_engine_models import make_tiny_model, random_prompts

torch.set_num_threads(1)


class FlakyIndex(MemoryIndex):
    """A real memory index whose publishes fail while `down` is set; counts the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.calls = 0

    async def publish(self, holder: str, stored: list[bytes], removed: list[bytes]) -> None:
        self.calls += 1
        if self.down:
            raise ConnectionError("index unreachable")
        await super().publish(holder, stored, removed)


@pytest.fixture
async def runtime(tmp_path):
    make_tiny_model(tmp_path, "llama", seed=7)
    ecfg = EngineConfig(model=str(tmp_path), device="cpu", cache=CacheConfig(kv_cache_memory=2 << 20),
                        scheduler=SchedulerConfig(max_model_len=256))
    engine = AsyncEngine(await asyncio.to_thread(LLMEngine, ecfg))
    await engine.start()
    rt = WorkerRuntime(WorkerConfig(engine=ecfg, kvstore=("127.0.0.1:1",), port=0), "decode", engine, FlakyIndex())
    try:
        yield rt
    finally:
        await engine.stop()


async def _generate(rt: WorkerRuntime, rid: str, prompt: list[int]) -> None:
    async for _ in rt.engine.generate(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2)):
        pass


async def test_local_lookups_drain_without_publishing_and_the_tick_publishes(runtime):
    rt, index = runtime, runtime.index
    prompt = random_prompts(1, 40, 40, seed=3)[0]  # two full blocks of 16
    await _generate(rt, "a", prompt)
    held = set(await rt.local_blocks())
    assert len(held) == 2 and index.calls == 0  # known locally at once, the index not asked
    assert await index.lookup(sorted(held)) == [frozenset(), frozenset()]
    await rt.publish_events()
    assert index.calls == 1 and await index.lookup(sorted(held)) == [frozenset({rt.holder})] * 2
    await rt.publish_events()
    assert index.calls == 1  # nothing new: no call


async def test_a_failed_publish_is_sent_again_with_what_came_after(runtime):
    rt, index = runtime, runtime.index
    await _generate(rt, "a", random_prompts(1, 40, 40, seed=4)[0])
    index.down = True
    with pytest.raises(ConnectionError):
        await rt.publish_events()
    await _generate(rt, "b", random_prompts(1, 33, 33, seed=5)[0])
    held = set(await rt.local_blocks())
    assert len(held) == 4
    index.down = False
    await rt.publish_events()
    assert await index.lookup(sorted(held)) == [frozenset({rt.holder})] * 4


async def test_concurrent_lookups_share_a_drain_begun_after_they_asked(runtime):
    """A burst of requests asks for the local blocks at once: they share one engine round trip (each
    waits for a step boundary) instead of queueing one apiece, and none gets a drain older than its call."""
    rt = runtime
    calls = []
    real_call = rt.engine.call

    async def counting_call(method, *args, **kwargs):
        if method == "drain_kv_events":
            calls.append(method)
            await asyncio.sleep(0.05)  # a step in flight
        return await real_call(method, *args, **kwargs)

    rt.engine.call = counting_call
    first = asyncio.ensure_future(rt.local_blocks())
    await asyncio.sleep(0.01)  # its drain is running
    await _generate(rt, "a", random_prompts(1, 40, 40, seed=6)[0])  # two blocks stored after it began
    held = await asyncio.gather(*(rt.local_blocks() for _ in range(32)))
    await first
    assert len(calls) == 2  # the first caller's drain, then one for all 32 that came later
    assert all(len(h) == 2 for h in held)  # the later drain saw the new blocks
