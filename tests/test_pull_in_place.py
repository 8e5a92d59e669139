"""A pull on one host: the kvstore writes the pages straight into the engine process's imports
segment (`EngineProcess.reserve_import`, `GrpcKVStoreClient.get(into=)`), the import names that
range instead of copying it, and the range comes back once the engine's copy out of it has landed.
Real parts: a kvstore server over gRPC on loopback, an engine process with its page segments, the
tests' tiny model on the CPU."""
from __future__ import annotations

import asyncio

import pytest

from kvmesh.block_transfer import BlockTransfer
from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.engine_process import EngineProcess
from kvmesh.engine.page_segments import WorkerPages
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.kvstore.client import GrpcKVStoreClient
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.server import KVStoreServer
from test_engine_models import make_tiny_model, random_prompts
from test_engine_process import until


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(d, "llama", seed=43)
    return str(d)


@pytest.fixture
async def node():
    server = KVStoreServer(KVStoreConfig(host="127.0.0.1", port=0, capacity_bytes=8 << 20, device="cpu",
                                         publish_interval=0.05))
    await server.start()
    yield server
    await server.stop(grace=0.5)


async def engine_process(model: str) -> EngineProcess:
    ep = EngineProcess(EngineConfig(model=model, device="cpu", cache=CacheConfig(kv_cache_memory=2 << 20),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=32)),
                       shared_memory_bytes=8 << 20)
    await ep.start()
    return ep


async def test_a_pull_lands_in_the_engines_imports_segment(model_dir, node, monkeypatch):
    fills = []
    real_fill = WorkerPages.fill
    monkeypatch.setattr(WorkerPages, "fill", staticmethod(lambda view, pages: fills.append(len(pages)) or
                                                          real_fill(view, pages)))
    prompt = random_prompts(1, 53, 53, seed=5)[0]  # three full pages and a tail
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a, b = await engine_process(model_dir), await engine_process(model_dir)
    client = GrpcKVStoreClient([node.address], shared_memory_bytes=4 << 20)
    try:
        layout = a.info.layout
        ta = BlockTransfer(client, layout, a.info.model_id, holder="a", lease_seconds=5)
        tb = BlockTransfer(client, layout, b.info.model_id, holder="b", lease_seconds=5)
        pre = [o async for o in a.generate("p", prompt, SamplingParams(temperature=0.0, max_tokens=1),
                                           export_kv=True)][-1]
        exp = await asyncio.to_thread(pre.kv_export.ready)
        assert (await ta.push(exp.blocks)).stored == 3
        exp.release()
        missing = b"m" * 32
        paths = []
        b.on_import = paths.append
        r = await tb.pull(b, [x.hash for x in exp.blocks] + [missing])
        assert paths == ["in_place"]
        assert r.imported == [x.hash for x in exp.blocks] and r.missing == 1
        assert fills == []  # the worker copied no page: the kvstore wrote them where the engine reads
        assert node._servicer.segments._open.keys() >= {b._pages.imports.name}
        await until(lambda: b._pages.imports.free_bytes == b._pages.imports.size)  # "imported" came
        assert client._arena.free_bytes == client._arena.size
        got = [o async for o in b.generate("x", prompt, greedy)][-1]
        ref = [o async for o in a.generate("ref", prompt, greedy)][-1]
        assert got.num_cached_tokens == 48  # the three pulled pages
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        # nothing pulled (all missing): the reserved range goes back at once
        r = await tb.pull(b, [missing])
        assert r.imported == [] and b._pages.imports.free_bytes == b._pages.imports.size
    finally:
        await client.close()
        await a.stop()
        await b.stop()


async def test_a_reservation_waits_for_room_and_gives_up_in_time(model_dir, monkeypatch):
    """A pull that finds the imports segment full waits for a range to come back (the pipe's
    fallback would stage its pages on the engine's main thread); one that cannot fit at all, or
    finds no room in time, gets None at once or at the deadline."""
    import kvmesh.engine.engine_process as engine_process_module

    ep = await engine_process(model_dir)
    try:
        size = ep._pages.imports.size
        assert await ep.reserve_import(size + 1) is None  # can never fit: no wait
        first = await ep.reserve_import(size)
        waiting = asyncio.create_task(ep.reserve_import(size // 2))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        ep.release_import(first)
        second = await asyncio.wait_for(waiting, 5)
        assert (second.offset, second.nbytes) == (0, size // 2)
        monkeypatch.setattr(engine_process_module, "IMPORT_SPACE_WAIT_S", 0.1)
        assert await ep.reserve_import(size) is None  # half is held: no room by the deadline
        ep.release_import(second)
        assert ep._pages.imports.free_bytes == size
        del first, second, waiting  # their views, before the segment closes
    finally:
        await ep.stop()
