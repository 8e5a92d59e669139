"""OutputCollector and merge_delta: what a lagging reader of an engine stream receives."""
from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.output_collector import OutputCollector
from kvmesh.engine.outputs import (CompletionOutput, KVExport, OutputKind, RequestOutput, TokenLogprob,
                                   merge_delta)


def out(*comps, finished=False, cached=0, prompt_lps=None, export=None, error=None) -> RequestOutput:
    return RequestOutput("r", [1, 2], list(comps), finished, cached, prompt_lps, export, error)


def comp(index, text, ids, lps=None, finish=None, stop=None) -> CompletionOutput:
    return CompletionOutput(index, text, list(ids), lps, finish, stop)


def test_delta_outputs_merge_in_order_forks_and_finish():
    c = OutputCollector(OutputKind.DELTA)
    lp = [TokenLogprob(5, -0.5)]
    c.put(out(comp(0, "a", [5], lps=lp), prompt_lps=[None, TokenLogprob(2, -1.0)], cached=16))
    c.put(out(comp(0, "b", [6], lps=[TokenLogprob(6, -0.25)]), comp(1, "x", [7]), cached=16))  # a fork joins
    export = KVExport.of([], 0, b"", "fp32")
    c.put(out(comp(1, "y", [8], finish="stop", stop="y"), comp(0, "", [], lps=[], finish="length"),
              finished=True, cached=16, export=export))
    assert len(c) == 1
    got = asyncio.run(c.get())
    assert [(o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in got.outputs] == [
        (0, "ab", [5, 6], "length", None), (1, "xy", [7, 8], "stop", "y")]
    assert [lp.token_id for lp in got.outputs[0].logprobs] == [5, 6]
    assert got.outputs[1].logprobs is None
    assert got.finished and got.kv_export is export and got.prompt_logprobs[1].token_id == 2


@pytest.mark.parametrize("kind", [OutputKind.CUMULATIVE, OutputKind.FINAL_ONLY])
def test_other_kinds_keep_the_newest(kind):
    c = OutputCollector(kind)
    c.put(out(comp(0, "a", [5])))
    newest = out(comp(0, "ab", [5, 6]), finished=True)
    c.put(newest)
    assert len(c) == 1 and asyncio.run(c.get()) is newest


def test_errors_and_aborts_are_never_merged_away():
    c = OutputCollector(OutputKind.DELTA)
    err = RuntimeError("engine stopped")
    c.put(out(comp(0, "a", [5])))
    c.put(err)
    c.put(out(comp(0, "b", [6])))
    c.put(out(comp(0, "c", [7]), error="bad"))  # a failed output stays its own item
    c.put(None)

    async def drain():
        return [await c.get() for _ in range(len(c))]
    items = asyncio.run(drain())
    assert items[0].outputs[0].text == "a" and items[1] is err and items[2].outputs[0].text == "b"
    assert items[3].error == "bad" and items[4] is None


async def test_get_waits_for_a_put():
    c = OutputCollector(OutputKind.DELTA)
    task = asyncio.create_task(c.get())
    await asyncio.sleep(0.01)
    assert not task.done()
    c.put(out(comp(0, "a", [5])))
    assert (await asyncio.wait_for(task, 1)).outputs[0].token_ids == [5]


async def test_a_held_get_merges_until_its_deadline():
    c = OutputCollector(OutputKind.DELTA)
    loop = asyncio.get_running_loop()

    async def engine():  # a step every 10 ms
        for i in range(6):
            c.put(out(comp(0, str(i), [i])))
            await asyncio.sleep(0.01)
    task = asyncio.create_task(engine())
    t0 = loop.time()
    first = await c.get(t0 + 0.035)
    assert loop.time() >= t0 + 0.035 and 3 <= len(first.outputs[0].token_ids) <= 5
    rest = await c.get(0.0)  # no hold: whatever is queued, or the next output
    await task
    while len(c):
        rest = merge_delta(rest, await c.get())
    assert first.outputs[0].token_ids + rest.outputs[0].token_ids == list(range(6))


@pytest.mark.parametrize("last", ["finished", "error", "abort"])
async def test_a_held_get_returns_at_once_when_the_stream_ends(last):
    c = OutputCollector(OutputKind.DELTA)
    loop = asyncio.get_running_loop()
    c.put(out(comp(0, "a", [5])))
    end = {"finished": out(comp(0, "b", [6], finish="stop"), finished=True),
           "error": RuntimeError("engine stopped"), "abort": None}[last]
    loop.call_later(0.01, c.put, end)
    t0 = loop.time()
    got = await c.get(t0 + 5.0)
    assert loop.time() - t0 < 1.0
    if last == "finished":
        assert got.finished and got.outputs[0].token_ids == [5, 6]
    else:
        assert got.outputs[0].token_ids == [5] and (await c.get(t0 + 5.0)) is end


async def test_outputs_put_during_a_hold_do_not_wake_the_reader():
    """Waking a held reader for every step would cost the event loop a task switch a step a
    stream: the very work the hold saves."""
    c = OutputCollector(OutputKind.DELTA)
    loop = asyncio.get_running_loop()
    c.put(out(comp(0, "a", [5])))
    task = asyncio.create_task(c.get(loop.time() + 0.05))
    await asyncio.sleep(0.005)  # the reader holds its output
    for i in range(3):
        c.put(out(comp(0, "b", [6 + i])))
        assert not c._ready.is_set()
    got = await task
    assert got.outputs[0].token_ids == [5, 6, 7, 8]
