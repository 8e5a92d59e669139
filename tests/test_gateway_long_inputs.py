"""Inputs of megabytes at the gateway: a prompt no context could hold is refused before it is
tokenized, and tokenizing, detokenizing or rendering a long one leaves the event loop (every other
stream) free."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

from kvmesh.gateway.app import GATEWAY
from loop_gaps import LoopGaps
from test_gateway_api import client, model_facts, start  # noqa: F401  (fixtures)


async def test_a_prompt_no_context_could_hold_is_refused_before_it_is_tokenized(client):  # noqa: F811
    """A 60 MB text took ~45 s of a core to tokenize (the event loop held all along) before the same
    400; its length alone shows it cannot fit. A token-id list is measured before it is decoded."""
    gw = client.server.app[GATEWAY]

    class Untouchable:
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            if name in ("encode", "decode"):
                raise AssertionError(f"{name} called on a prompt that cannot fit")
            return getattr(self.tok, name)

    tok, gw.tokenizer = gw.tokenizer, Untouchable(gw.tokenizer)
    try:
        for path, body, param in (
                ("/v1/completions", {"model": "smollm2", "prompt": "word " * 400_000}, "prompt"),
                ("/v1/chat/completions", {"model": "smollm2",
                                          "messages": [{"role": "user", "content": "word " * 400_000}]}, "messages"),
                ("/v1/completions", {"model": "smollm2", "prompt": list(range(100, 200_100))}, "prompt")):
            r = await client.post(path, json={**body, "max_tokens": 4})
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == param, err
        assert "at least" in err["message"] or "200004 tokens" in err["message"], err
    finally:
        gw.tokenizer = tok
    r = await client.post("/v1/completions", json={"model": "smollm2", "prompt": "word " * 10, "max_tokens": 80})
    assert r.status == 400 and "requested 91 tokens" in (await r.json())["error"]["message"]  # exact when short


async def test_a_long_detokenize_leaves_the_event_loop_running(client, model_facts):  # noqa: F811
    """3M ids took the loop ~1.2 s to check and decode (tokenizers' decode holds the GIL); long lists
    are checked in a thread and decoded through decode_batch, which lets the loop run."""
    tok, _ = model_facts
    ids = [100 + (i * 7919) % 40000 for i in range(3_000_000)]
    raw = json.dumps({"model": "smollm2", "tokens": ids}).encode()
    async with LoopGaps() as loop:
        r = await client.post("/detokenize", data=raw, headers={"Content-Type": "application/json"})
        text = (await r.json())["prompt"]
    assert r.status == 200 and text == tok.backend.decode(ids, skip_special_tokens=True)
    assert loop.longest < loop.seconds / 2, (loop.longest, loop.seconds)  # the body's json.loads is the longest


async def test_a_body_of_a_million_messages_is_checked_and_rendered_off_the_loop(client):  # noqa: F811
    """Parsing, checking and rendering 500k chat messages is Python on the event loop for ~1.5 s; a
    body of 1 MB or more does it in a thread, so only the body's json.loads holds the loop."""
    raw = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "x"}] * 500_000,
                      "max_tokens": 4}).encode()
    async with LoopGaps() as loop:
        r = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
        err = (await r.json())["error"]
    assert r.status == 400 and err["code"] == "context_length_exceeded", err
    assert loop.longest < loop.seconds / 2, (loop.longest, loop.seconds)


async def test_a_big_body_with_surrogate_pairs_is_walked_off_the_loop(client):  # noqa: F811
    """Every string of a body that may hold an unpaired surrogate is checked (1.7 s for a million
    messages), fields the request does not use too; a body of 1 MB or more is walked from a thread.
    A lone surrogate is still the client's 400."""
    raw = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                      "metadata": ["\U0001F600"] * 1_000_000}).encode()  # escaped as pairs by json.dumps
    async with LoopGaps() as loop:
        r = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
        await r.read()
    assert r.status != 500
    assert loop.longest < loop.seconds / 2, (loop.longest, loop.seconds)
    lone = raw.replace(b'"\\ud83d\\ude00"', b'"\\ud83d"', 1)
    r = await client.post("/v1/chat/completions", data=lone, headers={"Content-Type": "application/json"})
    assert r.status == 400 and (await r.json())["error"]["param"] == "metadata[0]"


async def test_a_chunked_big_body_is_checked_off_the_loop_too(client):  # noqa: F811
    """A body sent without Content-Length (chunked) is as big as its bytes: 500k chat messages were
    checked and rendered on the loop (~1.5 s) because only Content-Length was looked at."""
    raw = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "x"}] * 500_000,
                      "max_tokens": 4}).encode()

    async def chunks():
        for i in range(0, len(raw), 1 << 20):
            yield raw[i:i + (1 << 20)]

    async with LoopGaps() as loop:
        r = await client.post("/v1/chat/completions", data=chunks(), headers={"Content-Type": "application/json"})
        err = (await r.json())["error"]
    assert r.status == 400 and err["code"] == "context_length_exceeded", err
    assert loop.longest < loop.seconds / 2, (loop.longest, loop.seconds)


async def test_megabytes_to_tokenize_leave_the_threads_of_prompts_that_fit(model_facts):  # noqa: F811
    """Six clients tokenizing 1.5 MB each held every thread of the default executor (~0.7 s a
    request), so a 40k-character prompt that fits the context waited a second for one. Inputs longer
    than any prompt the context holds now queue on the gateway's bulk threads; the prompt does not."""
    c = await start(model_facts, max_model_len=8192, bulk_threads=2)
    default = ThreadPoolExecutor(4)  # the default executor's size fixed, whatever this machine's cores
    asyncio.get_running_loop().set_default_executor(default)
    try:
        big = {"model": "smollm2", "prompt": " ".join(["word"] * 300_000)}
        t0 = time.perf_counter()
        flood = [asyncio.create_task(c.post("/tokenize", json=big)) for _ in range(6)]
        await asyncio.sleep(0.5)  # every flood request tokenizing or queued
        t1 = time.perf_counter()
        r = await c.post("/tokenize", json={"model": "smollm2", "prompt": " ".join(["fits"] * 8_000)})
        waited = time.perf_counter() - t1
        assert r.status == 200 and (await r.json())["count"] == 8_000
        for f in flood:
            r = await f
            assert r.status == 200 and (await r.json())["count"] == 300_000
        flood_s = time.perf_counter() - t0
        assert waited < flood_s / 4, (waited, flood_s)
    finally:
        await c.close()
        default.shutdown(wait=False)


async def test_a_long_tokenize_result_is_rendered_off_the_loop(model_facts):  # noqa: F811
    """400k ids with their token strings are ~0.13 s of Python to render: off the loop now (the
    longest stall, ~0.35x of it, is measured against the same rendering timed inline here)."""
    from kvmesh.gateway import prompts
    c = await start(model_facts, max_model_len=8192)
    try:
        body = {"model": "smollm2", "prompt": " ".join(["word"] * 400_000), "return_token_strs": True}
        async with LoopGaps() as loop:
            r = await c.post("/tokenize", json=body)
            raw = await r.read()
        out = json.loads(raw)
        assert r.status == 200 and out["count"] == 400_000, out["count"]
        assert out["token_strs"][:2] == ["word", "Ġword"], out["token_strs"][:2]
        t0 = time.perf_counter()
        assert prompts.tokenized(c.server.app[GATEWAY], {"return_token_strs": True}, out["tokens"]) == raw
        render_s = time.perf_counter() - t0
        assert loop.longest < 0.7 * render_s, (loop.longest, render_s)  # inline: 1.1x
    finally:
        await c.close()


async def test_big_bodies_are_parsed_a_bulk_slot_at_a_time(model_facts):  # noqa: F811
    """A 61 MB body of one-letter messages is ~1.1 GB parsed and rendered: eight at once took the
    gateway to 6.1 GB. Big bodies are now parsed and prepared --bulk-threads at a time, the others
    kept as bytes: a big body of malformed JSON behind a slow one is answered after it, where it
    was answered at once."""
    c = await start(model_facts, max_model_len=8192, bulk_threads=1)
    try:
        long_text = {"model": "smollm2", "prompt": " ".join(["w"] * 1_500_000)}
        slow = asyncio.create_task(c.post("/tokenize", json=long_text))
        await asyncio.sleep(0.3)  # the slow one holds the slot, tokenizing
        bad = b'{"model": "smollm2", "prompt": "' + b"word " * 400_000 + b'", "max_tokens": 4'  # 2 MB, no }
        r = await c.post("/v1/completions", data=bad, headers={"Content-Type": "application/json"})
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        assert slow.done()  # before: answered while the slow one was tokenizing, ~1 s before it ended
        r = await slow
        assert r.status == 200 and (await r.json())["count"] == 1_500_000
    finally:
        await c.close()


async def test_big_bodies_past_eight_a_slot_get_a_429_unread(model_facts):  # noqa: F811
    """Big bodies waiting for a slot are kept as bytes (up to 64 MiB each): at most 8 per bulk slot
    are read or waiting; the next is refused before its body is read, and served once they are done."""
    c = await start(model_facts, max_model_len=8192, bulk_threads=1)
    try:
        long_text = {"model": "smollm2", "prompt": " ".join(["w"] * 1_500_000)}
        slow = asyncio.create_task(c.post("/tokenize", json=long_text))
        await asyncio.sleep(0.3)  # the slow one holds the slot
        big = {"model": "smollm2", "prompt": " ".join(["word"] * 250_000)}  # 1.25 MB
        waiting = [asyncio.create_task(c.post("/tokenize", json=big)) for _ in range(7)]
        await asyncio.sleep(0.3)  # all read, waiting for the slot
        r = await c.post("/tokenize", json=big)
        err = (await r.json())["error"]
        assert r.status == 429 and err["type"] == "rate_limit_exceeded" and r.headers["Retry-After"], err
        assert (await slow).status == 200
        assert [(await w).status for w in waiting] == [200] * 7
        r = await c.post("/tokenize", json=big)
        assert r.status == 200 and (await r.json())["count"] == 250_000
        assert c.server.app[GATEWAY].big_bodies == 0
    finally:
        await c.close()


async def test_a_client_that_leaves_keeps_its_bulk_slot_till_its_thread_is_done(model_facts):  # noqa: F811
    """A client that leaves cancels its handler, but not the thread at work on its input, which
    holds the body: the slot used to be let go at once, so clients uploading megabytes and leaving
    could pile parsed bodies up in the bulk queue without bound. Now the slot waits for the thread."""
    c = await start(model_facts, max_model_len=8192, bulk_threads=1)
    gw = c.server.app[GATEWAY]
    encoded_at = []

    class Timed:
        def __init__(self, tok):
            self.tok = tok

        def encode(self, *args, **kw):
            try:
                return self.tok.encode(*args, **kw)
            finally:
                encoded_at.append(time.perf_counter())

        def __getattr__(self, name):
            return getattr(self.tok, name)

    gw.tokenizer = Timed(gw.tokenizer)
    try:
        long_text = {"model": "smollm2", "prompt": " ".join(["w"] * 1_500_000)}
        left = asyncio.create_task(c.post("/tokenize", json=long_text))
        await asyncio.sleep(0.4)  # its body read, its text being tokenized in the bulk thread
        left.cancel()  # the client leaves: the connection closes
        await asyncio.gather(left, return_exceptions=True)
        bad = b'{"model": "smollm2", "prompt": "' + b"word " * 400_000 + b'", "max_tokens": 4'  # 2 MB, no }
        r = await c.post("/v1/completions", data=bad, headers={"Content-Type": "application/json"})
        answered = time.perf_counter()
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        assert len(encoded_at) == 1 and answered > encoded_at[0], (encoded_at, answered)  # before: 0.5 s ahead
        for _ in range(50):  # the handler's end, after its thread's
            if gw.big_bodies == 0:
                break
            await asyncio.sleep(0.1)
        assert gw.big_bodies == 0
    finally:
        await c.close()


async def test_a_big_body_is_parsed_in_turns_with_the_loop(client):  # noqa: F811
    """json.loads of 3M ids holds the GIL for its whole length (~0.2 s), in a thread or not; a big
    body is parsed in a thread with a Python hook for every number and object, so the loop gets
    its turns meanwhile. The longest stall is measured against json.loads timed here."""
    import urllib.error
    import urllib.request
    ids = [100 + (i * 7919) % 40000 for i in range(3_000_000)]
    raw = json.dumps({"model": "smollm2", "prompt": ids, "max_tokens": 4}).encode()

    def post() -> urllib.error.HTTPError:  # from a thread: an aiohttp client's 22 MB write on this
        req = urllib.request.Request(str(client.make_url("/v1/completions")), data=raw,  # loop stalls it
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60)
        except urllib.error.HTTPError as e:
            return e
    async with LoopGaps() as loop:
        r = await asyncio.to_thread(post)
    err = json.loads(r.read())["error"]
    assert r.code == 400 and err["code"] == "context_length_exceeded", err
    t0 = time.perf_counter()
    assert json.loads(raw)["prompt"] == ids
    loads_s = time.perf_counter() - t0
    assert loop.longest < loads_s / 2, (loop.longest, loads_s)
