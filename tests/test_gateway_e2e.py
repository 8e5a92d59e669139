"""The gateway in front of real workers (in-process, real gRPC on loopback, SmolLM2 on the CPU),
driven by the official `openai` client.

- non-streamed and streamed chat equal single-process kvmesh.LLM greedy output;
- a repeated long system prompt reports cached_tokens > 0 and answers identically;
- /v1/completions echo + logprobs + max_tokens 0 scores the prompt like the engine does;
- a dead decode worker is routed around; a client that hangs up frees the request on the worker;
- the gateway's block hashes are the engine's.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time

import aiohttp
import openai
import pytest
import pytest_asyncio
import torch
from aiohttp import web

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.decode.config import DecodeConfig
from kvmesh.decode.server import DecodeWorker
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.gateway import sse
from kvmesh.gateway.app import GATEWAY, build_app, start
from kvmesh.gateway.config import GatewayConfig
from kvmesh.index import MemoryIndex
from kvmesh.kvstore.client import GrpcKVStoreClient
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.server import KVStoreServer
from kvmesh.prefill.config import PrefillConfig
from kvmesh.prefill.server import PrefillWorker

pytestmark = pytest.mark.asyncio(loop_scope="module")

BS = 16
KV_MEMORY = 32 << 20
MAX_MODEL_LEN = 256
DEAD = "127.0.0.1:9"


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["river", "stone", "garden", "light", "music", "winter", "paper", "cloud", "engine", "forest"]
    return " ".join(rng.choice(vocab) for _ in range(n))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack():
    torch.set_num_threads(2)
    index = MemoryIndex()
    kvstore = KVStoreServer(KVStoreConfig(port=0, capacity_bytes=128 << 20, publish_interval=0.01), index=index)
    await kvstore.start()
    ecfg = EngineConfig(model="smollm2", device="cpu",
                        cache=CacheConfig(block_size=BS, kv_cache_memory=KV_MEMORY),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=MAX_MODEL_LEN))
    reference = await asyncio.to_thread(LLM, "smollm2", device="cpu", block_size=BS,
                                        kv_cache_memory=KV_MEMORY, max_num_seqs=4,
                                        max_model_len=MAX_MODEL_LEN)
    common = dict(engine=ecfg, kvstore=(kvstore.address,), port=0, publish_interval=0.01)
    kv_clients, workers = [], []
    for cls, wcfg in ((PrefillWorker, PrefillConfig(**common)), (DecodeWorker, DecodeConfig(**common))):
        kv = GrpcKVStoreClient([kvstore.address])
        kv_clients.append(kv)
        w = cls(wcfg, AsyncEngine(await asyncio.to_thread(LLMEngine, ecfg)), kv, index)
        await w.start()
        workers.append(w)
    prefill, decode = workers
    cfg = GatewayConfig(model="smollm2", prefill=(prefill.address,), decode=(decode.address, DEAD),
                        block_size=BS, max_model_len=MAX_MODEL_LEN, prefill_threshold_tokens=32,
                        request_timeout_s=120.0)
    runner, port = await start(cfg, index=index, tokenizer=reference.llm_engine.tokenizer,
                               health_checks=False)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    yield dict(client=client, gw=runner.app[GATEWAY], reference=reference, decode=decode, prefill=prefill,
               url=f"http://127.0.0.1:{port}")
    await client.close()
    await runner.cleanup()
    for w in workers:
        await w.stop(grace=0.5)
    for kv in kv_clients:
        await kv.close()
    await kvstore.stop(grace=0.5)


def ref_chat(stack, messages, max_tokens: int):
    out = stack["reference"].chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    return out.outputs[0]


async def test_hashes_match_the_engine(stack):
    eng = stack["reference"].llm_engine
    assert stack["gw"].hash_context("") == eng.hash_context("")
    assert stack["gw"].hash_context("t1") == eng.hash_context("t1")


async def test_dead_decode_worker_is_routed_around(stack):
    gw = stack["gw"]
    live = stack["decode"].address
    for _ in range(8):  # make the dead worker look cheaper so the router picks it first
        gw.router.begin(live)
    try:
        msgs = [{"role": "user", "content": "Name a colour."}]
        r = await stack["client"].chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                                          temperature=0)
    finally:
        for _ in range(8):
            gw.router.end(live)
    assert not gw.router.workers[DEAD].healthy and gw.router.workers[live].healthy
    assert r.choices[0].message.content == ref_chat(stack, msgs, 4).text


async def test_chat_non_streamed_and_streamed_equal_reference(stack):
    msgs = [{"role": "user", "content": f"Write about {words(6, 1)}."}]
    ref = ref_chat(stack, msgs, 12)
    client = stack["client"]
    r = await client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == stack["gw"].tokenizer.encode(
        stack["gw"].tokenizer.apply_chat_template(msgs), add_special_tokens=False).__len__()

    stream = await client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert text == ref.text and finish == ref.finish_reason
    assert usage.completion_tokens == len(ref.token_ids) and usage.prompt_tokens == r.usage.prompt_tokens


async def test_repeated_long_system_prompt_hits_cache(stack):
    system = "You are a careful assistant. " + words(110, 2)
    client = stack["client"]
    answers, cached = [], []
    for q in ("What is the first word?", "What is the first word?"):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        r = await client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0)
        answers.append(r.choices[0].message.content)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        await asyncio.sleep(0.3)  # let the workers publish their blocks to the index
    assert r.usage.prompt_tokens > 100
    assert cached[0] == 0 and cached[1] >= BS * ((r.usage.prompt_tokens - 1) // BS) - BS, cached
    assert answers[0] == answers[1] == ref_chat(stack, msgs, 8).text
    async with aiohttp.ClientSession() as s:
        text = await (await s.get(stack["url"] + "/metrics")).text()
    def value(prefix: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
        assert len(lines) == 1, (prefix, lines)
        return float(lines[0].split()[-1])

    assert value('kvmesh:router_decisions_total{model_name="smollm2",reason="hit"}') >= 1
    assert value("kvmesh:router_prefill_hops_total") >= 1  # the cold long prompt went through prefill
    # every prefill hop is timed
    assert value("kvmesh:prefill_call_seconds_count") == value("kvmesh:router_prefill_hops_total")
    assert value("kvmesh:prefill_call_seconds_sum") > 0
    assert value("kvmesh:prefix_cache_hits_total") >= cached[1]
    assert value("kvmesh:router_predicted_hit_tokens_total") > 0
    assert value("kvmesh:router_actual_hit_tokens_total") >= cached[1]
    assert value("kvmesh:num_requests_running") == 0 and value("kvmesh:num_requests_waiting") == 0


async def test_cache_salt_isolates_tenants(stack):
    system = "Tenant notes. " + words(60, 4)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Summarize."}]
    client = stack["client"]
    cached = []
    for salt in ("tenant-a", "tenant-a", "tenant-b"):
        r = await client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=2, temperature=0,
                                                 extra_body={"cache_salt": salt})
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        await asyncio.sleep(0.2)
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0, cached


async def test_chat_logprobs(stack):
    msgs = [{"role": "user", "content": "Say hello."}]
    r = await stack["client"].chat.completions.create(model="smollm2", messages=msgs, max_tokens=5,
                                                      temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(r.choices[0].message.content[:1])
    ref = stack["reference"].chat(msgs, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=2e-3)
    for c in content:  # greedy: the sampled token is the top one
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)


async def test_completion_echo_logprobs_scores_prompt(stack):
    tok = stack["gw"].tokenizer
    prompt = "The capital of France is Paris, and the capital of Italy is Rome"
    r = await stack["client"].completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True,
                                                 logprobs=2, temperature=0)
    c = r.choices[0]
    ids = tok.encode(prompt)
    assert c.text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = stack["reference"].generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    want = [x.logprob for x in ref.prompt_logprobs[1:]]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


async def test_completion_stream_and_n(stack):
    r = await stack["client"].completions.create(model="smollm2", prompt="Once upon a time", max_tokens=5,
                                                 n=2, temperature=0, seed=3,
                                                 extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].text == r.choices[1].text  # greedy: identical
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    assert r.usage.completion_tokens == 10
    async with aiohttp.ClientSession() as s:
        async with s.post(stack["url"] + "/v1/completions", json={
                "model": "smollm2", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0,
                "ignore_eos": True, "stream": True}) as resp:
            raw = await resp.read()
    events = sse.parse(raw)
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == r.choices[0].text


async def test_chat_stream_n2(stack):
    msgs = [{"role": "user", "content": "Pick a random animal."}]
    # greedy here; seeded samples are path independent too (test_disagg_serving, docs/gateway.md)
    kw = dict(model="smollm2", messages=msgs, max_tokens=6, temperature=0.0, n=2)
    r = await stack["client"].chat.completions.create(**kw)
    stream = await stack["client"].chat.completions.create(**kw, stream=True)
    texts, finishes, roles = ["", ""], [None, None], [0, 0]
    async for chunk in stream:
        c = chunk.choices[0]
        roles[c.index] += c.delta.role == "assistant"
        texts[c.index] += c.delta.content or ""
        finishes[c.index] = c.finish_reason or finishes[c.index]
    assert roles == [1, 1] and all(finishes)
    assert texts == [r.choices[0].message.content, r.choices[1].message.content]


async def test_stop_and_penalties_reach_the_worker(stack):
    prompt = "1, 2, 3, 4, 5,"
    kw = dict(temperature=0.0, max_tokens=12, stop=[" 8"], repetition_penalty=1.3, top_k=5)
    r = await stack["client"].completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0,
                                                 stop=[" 8"], extra_body={"repetition_penalty": 1.3, "top_k": 5})
    ref = stack["reference"].generate([prompt], SamplingParams(**kw))[0].outputs[0]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason


async def test_logit_bias_reaches_the_worker(stack):
    # +100 on one token makes greedy output that token; a token outside the vocabulary is the worker's 400
    client = stack["client"]
    forced = stack["reference"].get_tokenizer().encode(" banana", add_special_tokens=False)[0]
    r = await client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3,
                                        temperature=0, logit_bias={str(forced): 100})
    ref = stack["reference"].generate(["The capital of France is"], SamplingParams(
        temperature=0.0, max_tokens=3, logit_bias={forced: 100.0}))[0].outputs[0]
    assert ref.token_ids == [forced] * 3 and r.choices[0].text == ref.text
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="smollm2", prompt="x", max_tokens=2, logit_bias={"10000000": 5})
    assert "logit_bias" in str(e.value)


async def test_bad_input_through_openai_client(stack):
    client = stack["client"]
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": words(300, 3)}],
                                             max_tokens=4)
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="smollm2", prompt="x", temperature=-1)


async def test_client_disconnect_aborts_on_the_worker(stack):
    engine = stack["decode"].runtime.engine.engine
    gw = stack["gw"]
    async with aiohttp.ClientSession() as s:
        resp = await s.post(stack["url"] + "/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True})
        got = 0
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                got += 1
                if got >= 2:
                    break
        assert engine.has_unfinished()
        resp.close()  # hang up mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (engine.has_unfinished() or gw.router.workers[stack["decode"].address].in_flight):
        await asyncio.sleep(0.05)
    assert not engine.has_unfinished()
    assert gw.router.workers[stack["decode"].address].in_flight == 0 and gw.active == 0


async def test_stream_write_after_the_client_left_is_no_server_error(stack, caplog):
    """A stream whose client has hung up meets a closed connection at its next write: with handler
    cancellation off (here) every time, with it (as served) when the disconnect races a chunk's
    write, as the soak on the H200 hit 25 times in a minute. That is the client leaving: no 500 logged,
    the worker's request aborted, the gateway's count back to zero."""
    gw0 = stack["gw"]
    cfg = dataclasses.replace(gw0.cfg, decode=(stack["decode"].address,))
    app = build_app(cfg, index=MemoryIndex(), tokenizer=gw0.tokenizer, model_id=gw0.model_id, health_checks=False)
    runner = web.AppRunner(app, handler_cancellation=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine, gw = stack["decode"].runtime.engine.engine, app[GATEWAY]
    try:
        with caplog.at_level(logging.WARNING):
            async with aiohttp.ClientSession() as s:
                resp = await s.post(f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions", json={
                    "model": "smollm2", "messages": [{"role": "user", "content": "Count to a thousand."}],
                    "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True})
                got = 0
                async for line in resp.content:
                    got += line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line
                    if got >= 2:
                        break
                resp.close()  # hang up mid-stream
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (engine.has_unfinished() or gw.active):
                await asyncio.sleep(0.05)
        assert not engine.has_unfinished() and gw.active == 0
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []
    finally:
        await runner.cleanup()


async def test_non_streamed_client_disconnect_aborts_on_the_worker(stack):
    engine = stack["decode"].runtime.engine.engine
    gw = stack["gw"]
    body = {"model": "smollm2", "prompt": "Count: one two three", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0}
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(stack["url"] + "/v1/completions", json=body))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not engine.has_unfinished():
            await asyncio.sleep(0.02)
        assert engine.has_unfinished() and gw.active == 1
        task.cancel()  # the client gives up before the answer
        await asyncio.gather(task, return_exceptions=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (engine.has_unfinished() or gw.active):
        await asyncio.sleep(0.05)
    assert not engine.has_unfinished() and gw.active == 0
    # every load the router counted was given back
    assert all((w.in_flight, w.queued_tokens) == (0, 0) for w in gw.router.workers.values())


async def test_paced_stream_with_logprobs_through_the_openai_client(stack):
    """A decode worker pacing its streams sends several tokens a chunk: the client still gets the
    reference text, one logprob per token in order, and the usage."""
    msgs = [{"role": "user", "content": f"Tell me about {words(5, 3)}."}]
    ref = stack["reference"].chat(msgs, SamplingParams(temperature=0.0, max_tokens=16, logprobs=2,
                                                       ignore_eos=True))[0].outputs[0]
    servicer = stack["decode"].servicer
    servicer.max_chunk_rate = 5  # one stream: a chunk every 0.2 s, several steps on this CPU
    try:
        stream = await stack["client"].chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=16, temperature=0, stream=True, logprobs=True,
            top_logprobs=2, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, lps, chunks, usage = "", [], 0, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
                continue
            chunks += 1
            text += chunk.choices[0].delta.content or ""
            lps += chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []
    finally:
        servicer.max_chunk_rate = DecodeConfig.max_chunk_rate
    assert text == ref.text and usage.completion_tokens == len(ref.token_ids)
    assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=2e-3)
    assert all(len(lp.top_logprobs) == 2 for lp in lps)
    assert len(ref.token_ids) == 16 and chunks < 12  # a chunk a token would be 17 with the role's
