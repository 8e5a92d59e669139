"""AsyncEngine: streaming from a background engine thread, errors to the caller, cancellation
aborting the request and freeing its pages, block import between steps."""
from __future__ import annotations

import asyncio

import pytest
import torch

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from test_engine_models import make_tiny_model, random_prompts

torch.set_num_threads(1)  # 2 shared cores: more threads only add contention


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(d, "llama", seed=41)
    return str(d)


def make(model: str, overlap: bool = False) -> LLMEngine:
    """overlap: async scheduling (`engine/inflight.py`), as on a GPU."""
    return LLMEngine(EngineConfig(model=model, device="cpu", cache=CacheConfig(kv_cache_memory=2 << 20),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=32, async_scheduling=overlap)))


async def collect(ae: AsyncEngine, rid: str, prompt, params) -> list:
    return [o async for o in ae.generate(rid, prompt, params)]


@pytest.mark.parametrize("overlap", [False, True])
async def test_concurrent_streams_match_the_sync_engine(model_dir, overlap):
    prompts = random_prompts(4, 5, 40, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    sync = make(model_dir)
    for i, p in enumerate(prompts):
        sync.add_request(f"r{i}", p, params)
    ref = {}
    while sync.has_unfinished():
        for o in sync.step():
            ref[o.request_id] = o.outputs[0].token_ids
    ae = AsyncEngine(make(model_dir, overlap))
    await ae.start()
    try:
        streams = await asyncio.gather(*(collect(ae, f"r{i}", p, params) for i, p in enumerate(prompts)))
    finally:
        await ae.stop()
    assert (ae.engine.stats().async_steps > 0) == overlap
    for i, items in enumerate(streams):
        assert items[-1].finished and not any(o.finished for o in items[:-1])
        counts = [len(o.outputs[0].token_ids) for o in items]  # cumulative: one item a step the reader saw
        assert counts == sorted(set(counts)) and counts[-1] == 16
        assert items[-1].outputs[0].token_ids == ref[f"r{i}"]


async def test_bad_request_raises_and_cancel_frees_blocks(model_dir):
    ae = AsyncEngine(make(model_dir))
    await ae.start()
    try:
        with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
            await collect(ae, "bad", [], SamplingParams())
        gen = ae.generate("long", random_prompts(1, 30, 30, seed=2)[0],
                          SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        first = await gen.__anext__()
        assert not first.finished
        used = await ae.run(lambda e: e.stats().kv_cache_usage)
        assert used > 0
        await gen.aclose()  # the client went away
        for _ in range(100):
            st = await ae.run(lambda e: e.stats())
            if st.kv_cache_usage == 0.0 and st.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert st.kv_cache_usage == 0.0 and st.num_running == 0
        assert not await ae.run(lambda e: e.has_unfinished())
    finally:
        await ae.stop()


async def test_a_caller_gone_while_its_request_is_being_added_aborts_it(model_dir):
    """Cancelled while add_request waits for the engine thread, the request was added all the same:
    leaving must abort it, not leave it generating for nobody (a soak's abandoned streams did)."""
    import time as _time
    ae = AsyncEngine(make(model_dir))
    await ae.start()
    try:
        busy = asyncio.create_task(ae.run(lambda e: _time.sleep(0.3)))  # the engine thread is busy
        await asyncio.sleep(0.05)
        stream = asyncio.create_task(collect(ae, "gone", random_prompts(1, 20, 20, seed=5)[0],
                                             SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)))
        await asyncio.sleep(0.05)  # its add_request waits behind the busy call
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream
        await busy
        await ae.run(lambda e: None)  # the add, then the abort, have run
        st = await ae.run(lambda e: e.stats())
        assert not await ae.run(lambda e: e.has_unfinished())
        assert st.kv_cache_usage == 0.0 and st.num_running == 0
    finally:
        await ae.stop()


async def test_import_blocks_and_resume_through_the_async_api(model_dir):
    from kvmesh.engine.outputs import ResumeState
    prompt = random_prompts(1, 37, 37, seed=3)[0]
    a = AsyncEngine(make(model_dir))
    b = AsyncEngine(make(model_dir))
    await a.start()
    await b.start()
    try:
        pre = [o async for o in a.generate("q", prompt, SamplingParams(temperature=0.0, max_tokens=1),
                                           export_kv=True)][-1]
        exp = pre.kv_export
        assert await b.import_blocks(exp.blocks) == 2
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        out = [o async for o in b.generate("x", prompt, params, resume=ResumeState(
            pre.outputs[0].token_ids, exp.tail_tokens, exp.tail))][-1]
        ref = (await collect(a, "ref", prompt, params))[-1]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    finally:
        await a.stop()
        await b.stop()


async def test_abort_ends_the_stream(model_dir):
    ae = AsyncEngine(make(model_dir))
    await ae.start()
    try:
        gen = ae.generate("a", random_prompts(1, 20, 20, seed=4)[0],
                          SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        got = [await gen.__anext__()]
        await ae.abort("a")
        got += [o async for o in gen]
        assert not any(o.finished for o in got)
        st = await ae.run(lambda e: e.stats())
        assert st.kv_cache_usage == 0.0 and st.num_running == 0
    finally:
        await ae.stop()


@pytest.mark.parametrize("overlap", [False, True])
async def test_a_lagging_reader_gets_the_same_stream_in_fewer_outputs(model_dir, overlap):
    """DELTA outputs queued while the reader sleeps arrive merged: fewer items, the same tokens, text,
    logprobs and n > 1 completions as the synchronous engine's step-by-step deltas."""
    from kvmesh.engine.outputs import OutputKind
    prompts = random_prompts(3, 5, 30, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1)]

    def joined(items) -> dict:
        per: dict = {}
        for o in items:
            for c in o.outputs:
                text, toks, lps, fin = per.get(c.index, ("", [], [], None))
                per[c.index] = (text + c.text, toks + c.token_ids, lps + [(lp.token_id, round(lp.logprob, 4))
                                                                         for lp in c.logprobs or []],
                                c.finish_reason or fin)
        return per

    sync = make(model_dir)
    ref: dict = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        sync.add_request(f"r{i}", p, sp, output_kind=OutputKind.DELTA)
    while sync.has_unfinished():
        for o in sync.step():
            ref.setdefault(o.request_id, []).append(o)
    ae = AsyncEngine(make(model_dir, overlap))
    await ae.start()

    async def lagging(i):
        items = []
        async for o in ae.generate(f"r{i}", prompts[i], params[i], output_kind=OutputKind.DELTA):
            items.append(o)
            await asyncio.sleep(0.05)  # several steps pass: their outputs wait, merged
        return items
    try:
        streams = await asyncio.gather(*(lagging(i) for i in range(3)))
    finally:
        await ae.stop()
    for i, items in enumerate(streams):
        want = joined(ref[f"r{i}"])
        assert joined(items) == want
        assert items[-1].finished and not any(o.finished for o in items[:-1])
        assert sum(len(c.token_ids) for c in ref[f"r{i}"][-1].outputs) > 0
    assert len(streams[0]) < len(ref["r0"]) and len(streams[1]) < len(ref["r1"])  # merged, not one a step
