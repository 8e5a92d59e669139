"""EngineProcess: the engine in a spawned process of its own, driven through the same interface as
the in-process AsyncEngine. Real processes, a real pipe, the tests' tiny model on the CPU: streams
equal the in-process engine's, errors cross as the right exceptions, a closed stream aborts its
request, KV exports and imports carry the same bytes, and a process that dies fails what was open."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.engine_process import EngineProcess
from kvmesh.engine.outputs import ExportedBlock, OutputKind, ResumeState
from kvmesh.engine.sampling_params import SamplingParams
from test_engine_models import make_tiny_model, random_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(d, "llama", seed=43)
    return str(d)


def config(model: str) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", cache=CacheConfig(kv_cache_memory=2 << 20),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32))


async def started(model: str, shared_memory_bytes: int = 0) -> EngineProcess:
    ep = EngineProcess(config(model), shared_memory_bytes=shared_memory_bytes)
    await ep.start()
    return ep


async def until(condition, timeout: float = 10.0) -> None:
    """Waits for `condition()` (a message the engine process sends after a call's result)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.01)


def reference(model: str, prompts, params) -> dict:
    """The in-process engine's cumulative outputs, stepped to the end."""
    eng = LLMEngine(config(model))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    ref = {}
    while eng.has_unfinished():
        for o in eng.step():
            ref[o.request_id] = o
    return ref


async def test_streams_equal_the_in_process_engine(model_dir):
    prompts = random_prompts(4, 5, 40, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, prompt_logprobs=1)]
    ref = reference(model_dir, prompts, params)
    ep = await started(model_dir)
    try:
        assert ep.info.layout.block_size == 16 and ep.info.dtype_name == "fp32"

        async def run(i: int, kind: OutputKind) -> list:
            return [o async for o in ep.generate(f"r{i}", prompts[i], params[i], output_kind=kind)]

        kinds = [OutputKind.DELTA, OutputKind.CUMULATIVE, OutputKind.DELTA, OutputKind.FINAL_ONLY]
        streams = await asyncio.gather(*(run(i, k) for i, k in enumerate(kinds)))
    finally:
        await ep.stop()
    for i, (items, kind) in enumerate(zip(streams, kinds)):
        want = ref[f"r{i}"]
        assert items[-1].finished and all(o.prompt_token_ids == prompts[i] for o in items)
        for c_want in want.outputs:
            cs = [c for o in items for c in o.outputs if c.index == c_want.index]
            if kind is OutputKind.DELTA:  # the deltas joined are the whole completion
                tokens, text = [t for c in cs for t in c.token_ids], "".join(c.text for c in cs)
                lps = [lp for c in cs for lp in (c.logprobs or [])]
            else:
                tokens, text, lps = cs[-1].token_ids, cs[-1].text, cs[-1].logprobs or []
            assert tokens == c_want.token_ids and text == c_want.text
            # batches form differently when requests arrive apart: the same tokens, float sums in another order
            want_lps = c_want.logprobs or []
            assert [(lp.token_id, [t for t, _ in lp.top]) for lp in lps] == \
                [(lp.token_id, [t for t, _ in lp.top]) for lp in want_lps]
            assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in want_lps], abs=1e-4)
        if params[i].prompt_logprobs is not None:
            got = next(o.prompt_logprobs for o in items if o.prompt_logprobs is not None)
            assert [lp and lp.token_id for lp in got] == [lp and lp.token_id for lp in want.prompt_logprobs]
            assert [lp.logprob for lp in got[1:]] == pytest.approx([lp.logprob for lp in want.prompt_logprobs[1:]],
                                                                    abs=1e-4)
    assert len(streams[3]) == 1  # FINAL_ONLY: one output


async def test_errors_cross_as_their_kind_and_a_closed_stream_aborts(model_dir):
    ep = await started(model_dir)
    try:
        with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
            [o async for o in ep.generate("bad", [], SamplingParams())]
        with pytest.raises(ValueError, match="no call 'runner'"):
            await ep.call("runner")
        gen = ep.generate("long", random_prompts(1, 30, 30, seed=2)[0],
                          SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        first = await gen.__anext__()
        assert not first.finished
        assert (await ep.call("stats")).kv_cache_usage > 0
        await gen.aclose()  # the client went away
        for _ in range(200):
            st = await ep.call("stats")
            if st.kv_cache_usage == 0.0 and st.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert st.kv_cache_usage == 0.0 and st.num_running == 0
        assert not await ep.call("has_unfinished")
        # abort(): the stream ends without a final output
        gen = ep.generate("a", random_prompts(1, 20, 20, seed=4)[0],
                          SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        got = [await gen.__anext__()]
        await ep.abort("a")
        got += [o async for o in gen]
        assert not any(o.finished for o in got)
    finally:
        await ep.stop()
    with pytest.raises(RuntimeError, match="engine stopped"):
        await ep.call("stats")


async def test_a_caller_gone_while_its_request_is_being_added_aborts_it(model_dir):
    ep = await started(model_dir)
    try:
        for i in range(3):
            gen = ep.generate(f"gone{i}", random_prompts(1, 20, 20, seed=6 + i)[0],
                              SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0)  # add_request is on its way to the engine process
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            await gen.aclose()
            # the pipe keeps order: the add, then its abort, then this call
            assert not await ep.call("has_unfinished")
        assert (await ep.call("stats")).kv_cache_usage == 0.0
    finally:
        await ep.stop()


@pytest.mark.parametrize("shared", [0, 8 << 20], ids=["pipes", "shared-memory"])
async def test_kv_export_import_and_resume_across_processes(model_dir, shared):
    prompt = random_prompts(1, 37, 37, seed=3)[0]
    local = LLMEngine(config(model_dir))
    local.add_request("q", prompt, SamplingParams(temperature=0.0, max_tokens=1), export_kv=True)
    while local.has_unfinished():
        outs = local.step()
    want = outs[-1].kv_export
    a, b = await started(model_dir, shared), await started(model_dir, shared)
    try:
        pre = [o async for o in a.generate("q", prompt, SamplingParams(temperature=0.0, max_tokens=1),
                                           export_kv=True)][-1]
        exp = pre.kv_export
        await asyncio.to_thread(exp.ready)
        # with segments the pages are views into the exports segment, else bytes off the pipe
        assert all(isinstance(x.data, memoryview if shared else bytes) for x in exp.blocks)
        assert [(x.hash, x.token_ids, len(x.data)) for x in exp.blocks] == \
            [(x.hash, x.token_ids, len(x.data)) for x in want.blocks]
        assert (exp.tail_tokens, exp.tail_dtype) == (want.tail_tokens, want.tail_dtype)
        # the same values (fp32 KV; the test process may run torch on fewer threads, so float sums differ)
        for got, ref in [(x.data, y.data) for x, y in zip(exp.blocks, want.blocks)] + [(exp.tail, want.tail)]:
            np.testing.assert_allclose(np.frombuffer(got, np.float32), np.frombuffer(ref, np.float32), rtol=1e-5,
                                       atol=1e-6)
        with pytest.raises(ValueError, match="this engine's page is"):  # checked in the engine process
            await b.import_blocks([ExportedBlock(exp.blocks[0].hash, exp.blocks[0].token_ids, b"short")])
        with pytest.raises(ValueError, match="must be bytes"):  # refused before the pipe's writer sees it
            await b.import_blocks([ExportedBlock(exp.blocks[0].hash, exp.blocks[0].token_ids, "text")])
        paths = []
        b.on_import = paths.append
        assert await b.import_blocks(exp.blocks) == 2
        assert paths == ["shared_memory" if shared else "pipe"]
        if shared:  # the import's range is back once the engine's copy out of it has landed
            await until(lambda: b._pages.imports.free_bytes == b._pages.imports.size)
        assert [h for kind, h in await b.call("drain_kv_events") if kind == "stored"] == [x.hash for x in exp.blocks]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        out = [o async for o in b.generate("x", prompt, params, resume=ResumeState(
            pre.outputs[0].token_ids, exp.tail_tokens, exp.tail))][-1]
        ref = [o async for o in a.generate("ref", prompt, params)][-1]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.num_cached_tokens == len(prompt)  # both pages from the import, the tail from the resume
    finally:
        await a.stop()
        await b.stop()


async def test_a_dead_engine_process_fails_its_streams_and_calls(model_dir):
    ep = await started(model_dir)
    lost = []
    ep.on_lost = lost.append
    try:
        gen = ep.generate("long", random_prompts(1, 30, 30, seed=5)[0],
                          SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        await gen.__anext__()
        os.kill(ep.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"engine process exited \(code"):
            async for _ in gen:
                pass
        assert lost and "exited" in lost[0]
        with pytest.raises(RuntimeError, match="exited"):
            await ep.call("stats")
    finally:
        await ep.stop()


async def test_an_engine_that_cannot_load_fails_start_with_its_reason(tmp_path):
    ep = EngineProcess(config(str(tmp_path / "no-such-model")))
    with pytest.raises(RuntimeError, match="could not start: .*no-such-model"):
        await ep.start()


async def test_a_worker_whose_engine_process_dies_stops_serving(model_dir):
    """The decode worker's runtime hears of its engine's death, turns NOT_SERVING and stops, so
    whoever runs it sees the worker exit instead of a live port that fails every request."""
    from kvmesh.decode.config import DecodeConfig
    from kvmesh.decode.server import DecodeWorker
    from kvmesh.index import MemoryIndex

    ep = await started(model_dir)
    worker = DecodeWorker(DecodeConfig(engine=config(model_dir), kvstore=("127.0.0.1:1",), port=0), ep, None,
                          MemoryIndex())
    await worker.start()
    try:
        assert worker.transfer.layout == ep.info.layout
        os.kill(ep.pid, signal.SIGKILL)
        await asyncio.wait_for(worker.runtime.wait(), 30)
    finally:
        await worker.stop()


def test_the_worker_side_imports_no_torch():
    """A worker whose engine runs apart keeps only the gRPC side in its process: no torch there
    (68 MiB resident against ~480 with the engine on a thread, tiny model on the CPU)."""
    import subprocess
    import sys
    code = ("import sys, kvmesh.cli, kvmesh.decode.server, kvmesh.prefill.server, kvmesh.engine.engine_process; "
            "print(sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "torch" not in out.stdout and "triton" not in out.stdout, out.stdout


@pytest.mark.parametrize("export_first", [True, False])
def test_an_export_settles_whichever_of_it_and_its_output_comes_first(export_first):
    """Exports come on a pipe of their own: the pages may reach the worker before the output that
    announces them, or after; either way the output's export holds them (or the failure)."""
    from kvmesh.engine.engine_core import ExportPending
    from kvmesh.engine.outputs import CompletionOutput, RequestOutput

    ep = EngineProcess(config("unused"))
    ep._added("r", [1, 2, 3])
    blocks = [ExportedBlock(b"h" * 32, list(range(16)), b"page")]
    output = RequestOutput("r", [], [CompletionOutput(0, "x", [7], None, "length")], True, 0, None,
                           kv_export=ExportPending(3, "fp16"))
    delivered = []
    ep._deliver = delivered.extend
    messages = [("export", "r", blocks, b"tail"), ("outputs", [output])]
    for msg in messages if export_first else messages[::-1]:
        ep._on_message(msg)
    (out,) = delivered
    assert out.prompt_token_ids == [1, 2, 3] and out.kv_export.tail_tokens == 3
    assert out.kv_export.ready().blocks == blocks and out.kv_export.tail == b"tail"
    assert not ep._exports and not ep._early
    failing = RequestOutput("f", [], [], True, 0, None, kv_export=ExportPending(0, "fp16"))
    ep._on_message(("export_failed", "f", "copy failed"))
    ep._on_message(("outputs", [failing]))
    with pytest.raises(RuntimeError, match="copy failed"):
        delivered[-1].kv_export.ready()


async def test_an_export_range_is_reused_once_released_and_a_full_segment_falls_back_to_the_pipe(model_dir):
    """The exports segment holds one request's pages here: a second export while the first is
    unreleased comes on the pipe (bytes); once both are released the next comes through the segment
    again. The segments are gone from /dev/shm after stop."""
    prompt = random_prompts(1, 37, 37, seed=4)[0]  # two full pages
    page = LLMEngine(config(model_dir)).layout.block_bytes
    ep = await started(model_dir, 2 * 3 * page)  # each segment 3 pages: one export of two fits
    params = SamplingParams(temperature=0.0, max_tokens=1)

    async def export(rid: str):
        exp = [o async for o in ep.generate(rid, prompt, params, export_kv=True)][-1].kv_export
        return await asyncio.to_thread(exp.ready)

    names = ep._pages.names
    try:
        first = await export("a")
        second = await export("b")
        assert all(isinstance(x.data, memoryview) for x in first.blocks)
        assert all(isinstance(x.data, bytes) for x in second.blocks)  # no room: the pipe
        assert [bytes(x.data) for x in first.blocks] == [x.data for x in second.blocks]  # same prompt, same pages
        first.release()
        second.release()  # an export off the pipe has no range: harmless
        third = await export("c")
        assert all(isinstance(x.data, memoryview) for x in third.blocks)
        assert [bytes(x.data) for x in third.blocks] == [x.data for x in second.blocks]
    finally:
        await ep.stop()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in (names.exports, names.imports))


@pytest.mark.gpu
def test_exports_land_in_the_page_locked_segment_on_a_gpu():
    """SmolLM2 with INT4 KV on the GPU: the exported pages are copied from the pool straight into
    the registered exports segment and equal the in-process engine's, bit for bit; imported
    through the imports segment into a second engine process, they resume to the same tokens."""
    import dataclasses

    import torch

    cfg = EngineConfig(model=os.environ.get("KVMESH_SMOLLM2_GGUF", "smollm2"), device="cuda", dtype="bf16",
                       cache=CacheConfig(kv_cache_memory=64 << 20, kv_cache_dtype="int4"))
    prompt = random_prompts(1, 200, 200, seed=6, vocab=30000)[0]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    local = LLMEngine(cfg)
    local.add_request("q", prompt, one, export_kv=True)
    while local.has_unfinished():
        outs = local.step()
    want = outs[-1].kv_export.ready()
    del local
    torch.cuda.empty_cache()

    async def main():
        a, b = (EngineProcess(dataclasses.replace(cfg), shared_memory_bytes=64 << 20) for _ in range(2))
        await a.start()
        await b.start()
        try:
            pre = [o async for o in a.generate("q", prompt, one, export_kv=True)][-1]
            exp = await asyncio.to_thread(pre.kv_export.ready)
            assert all(isinstance(x.data, memoryview) for x in exp.blocks)  # through the segment
            assert [bytes(x.data) for x in exp.blocks] == [x.data for x in want.blocks]
            assert exp.tail == want.tail
            assert await b.import_blocks(exp.blocks) == len(exp.blocks)  # straight out of the imports segment
            exp.release()
            await until(lambda: b._pages.imports.free_bytes == b._pages.imports.size)  # "imported" came
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            out = [o async for o in b.generate("x", prompt, params, resume=ResumeState(
                pre.outputs[0].token_ids, exp.tail_tokens, exp.tail))][-1]
            # the same resume where the pages were computed (INT4: a fresh prefill of the whole prompt
            # attends to unquantized keys within its chunk, so only a resume is the same computation)
            ref = [o async for o in a.generate("ref", prompt, params, resume=ResumeState(
                pre.outputs[0].token_ids, exp.tail_tokens, exp.tail))][-1]
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert out.num_cached_tokens == len(prompt)
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


async def test_an_engine_that_cannot_map_the_segments_takes_the_pipes(model_dir, monkeypatch):
    """Segment names the engine process cannot open: it says so in its "ready", and the worker
    closes its segments and moves every page through the pipes."""
    from kvmesh.engine.page_segments import SegmentNames, WorkerPages

    monkeypatch.setattr(WorkerPages, "names", property(lambda self: SegmentNames("kvmesh-gone-a", "kvmesh-gone-b",
                                                                                  self.exports.size)))
    ep = await started(model_dir, 8 << 20)
    try:
        assert ep._pages is None
        prompt = random_prompts(1, 37, 37, seed=8)[0]
        out = [o async for o in ep.generate("p", prompt, SamplingParams(temperature=0.0, max_tokens=1),
                                            export_kv=True)][-1]
        exp = await asyncio.to_thread(out.kv_export.ready)
        assert len(exp.blocks) == 2 and all(isinstance(x.data, bytes) for x in exp.blocks)
        assert await ep.import_blocks(exp.blocks) == 0  # already cached there; through the pipe
    finally:
        await ep.stop()
