"""WorkerRuntime's prefix-cache events: the drains keep the worker's view of its engine's blocks
(what a pull skips) without a round trip to the index; the publish tick sends each hash's last
state, and retries a failed one."""
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
        self.calls += bool(stored or removed)  # MemoryIndex.drop_holder (the first flush's) comes here empty
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


async def test_the_known_blocks_follow_the_drains_and_the_tick_publishes(runtime):
    rt, index = runtime, runtime.index
    prompt = random_prompts(1, 40, 40, seed=3)[0]  # two full blocks of 16
    await _generate(rt, "a", prompt)
    assert rt.known_blocks() == set()  # not drained yet: a pull would fetch them again (harmless)
    await rt.publish_events()
    held = set(rt.known_blocks())
    assert len(held) == 2 and index.calls == 1
    assert await index.lookup(sorted(held)) == [frozenset({rt.holder})] * 2
    await rt.publish_events()
    assert index.calls == 1  # nothing new: no call


async def test_a_failed_publish_is_sent_again_with_what_came_after(runtime):
    rt, index = runtime, runtime.index
    await _generate(rt, "a", random_prompts(1, 40, 40, seed=4)[0])
    index.down = True
    with pytest.raises(ConnectionError):
        await rt.publish_events()
    assert len(rt.known_blocks()) == 2  # drained, though not published
    await _generate(rt, "b", random_prompts(1, 33, 33, seed=5)[0])
    index.down = False
    await rt.publish_events()
    held = set(rt.known_blocks())
    assert len(held) == 4
    assert await index.lookup(sorted(held)) == [frozenset({rt.holder})] * 4


async def test_a_pull_with_a_stale_view_refetches_and_the_import_skips_what_is_held(runtime, tmp_path):
    """What `known_blocks` trades: blocks stored since the last drain are fetched again, and the
    engine's import takes none of them twice."""
    from kvmesh.block_transfer import BlockTransfer
    from kvmesh.kvstore.client import LocalKVStoreClient
    from kvmesh.kvstore.config import KVStoreConfig
    from kvmesh.kvstore.store import BlockStore

    rt = runtime
    engine = rt.engine
    prompt = random_prompts(1, 40, 40, seed=8)[0]
    exported = [o async for o in engine.generate("x", prompt, SamplingParams(temperature=0.0, max_tokens=1),
                                                 export_kv=True)][-1].kv_export
    await asyncio.to_thread(exported.ready)
    store = BlockStore(KVStoreConfig(capacity_bytes=1 << 20))
    t = BlockTransfer(LocalKVStoreClient(store), engine.info.layout, engine.info.model_id, holder="w", lease_seconds=5)
    assert (await t.push(exported.blocks)).stored == 2
    assert rt.known_blocks() == set()  # the engine holds both, the worker has not drained since
    r = await t.pull(engine, [b.hash for b in exported.blocks], local=rt.known_blocks())
    assert len(r.imported) == 2 and r.missing == 0  # fetched again
    assert await engine.call("import_blocks", exported.blocks) == 0  # the engine takes no page it holds
    await rt.publish_events()
    assert rt.known_blocks() == {b.hash for b in exported.blocks}
    r = await t.pull(engine, [b.hash for b in exported.blocks], local=rt.known_blocks())
    assert r.imported == [] and r.get_seconds == 0.0  # known now: no store call
