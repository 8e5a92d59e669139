"""Disaggregated serving end to end on the CPU: real gRPC on loopback, a real kvstore node in-process,
SmolLM2 in every engine. The test plays the gateway (hashes, index lookup, prefill hop, decode stream).

- prefill -> kvstore -> decode greedy output equals single-process kvmesh.LLM, for fp32 and fp8 KV;
- a second conversation turn hits, on another decode worker, the blocks the first turn's decode
  worker wrote;
- cancelling a Generate stream frees the request's blocks at once;
- a short prompt with do_prefill works without a prefill hop.

The stack: tests/disagg_stack.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.decode.config import DecodeConfig
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.wire import convert
from kvmesh.wire import kvmesh_pb2 as pb

from disagg_stack import BS, MAX_MODEL_LEN, Stack, disaggregated, greedy, random_prompt, stack  # noqa: F401

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_disaggregated_text_keeps_an_unfinished_last_character(stack: Stack):
    """Greedy output that stops inside a multi-byte character ends with U+FFFD on both paths, as a
    whole-sequence decode gives it: the decode worker, which exports its blocks for the next turn,
    still flushes the held-back bytes at the end, and so does a prefill that is the whole request
    (max_tokens 1); only a prefill hop that hands the sequence on holds them back. This prompt's
    output (SmolLM2, fp32 and fp8 KV alike) starts ' ע' and stops after a lone lead byte."""
    rng = random.Random(155)
    prompt = [rng.randrange(100, 49000) for _ in range(2 * BS + 5)]
    for max_tokens in (10, 1):
        params = greedy(max_tokens)
        ref = (await asyncio.to_thread(stack.reference.generate, [prompt], params))[0].outputs[0]
        assert ref.text.endswith("\ufffd"), ref.text  # the case this test is about
        tokens, text, _, _ = await disaggregated(stack, prompt, params)
        assert tokens == ref.token_ids
        assert text == ref.text


async def test_disaggregated_output_equals_single_process(stack: Stack):
    prompt = random_prompt(2 * BS + 5)
    params = greedy(10)
    ref = (await asyncio.to_thread(stack.reference.generate, [prompt], params))[0].outputs[0]
    # The gateway "found" the prompt's blocks, but the store never had them: prefill recomputes.
    tokens, text, reply, chunks = await disaggregated(stack, prompt, params, cached=stack.hashes(prompt))
    assert tokens == ref.token_ids
    assert text == ref.text
    assert chunks[-1].finish_reason == "length" and all(not c.finish_reason for c in chunks[:-1])
    assert reply.num_cached_tokens == 0
    assert [b.hash for b in reply.blocks] == stack.hashes(prompt)
    assert {b.node for b in reply.blocks} == {stack.kvstore.address}
    assert reply.tail.num_tokens == 5 and reply.tail.dtype == "fp32"
    # The prompt's blocks are in the store now (the decode worker pulled them from there), and they
    # moved through the workers' shared memory (both on this host), not gRPC messages.
    present = await stack.clients[0].contains(stack.hashes(prompt))
    assert present == [True, True]
    opened = set(stack.kvstore._servicer.segments._open)
    assert {c._arena.name for c in stack.clients[:2]} <= opened and not any(c._no_shm for c in stack.clients)


@pytest.mark.parametrize("stack", ["auto"], indirect=True)
async def test_seeded_sample_through_prefill_hop_equals_single_process(stack: Stack):
    """The prefill worker draws the first token, the decode worker the rest: with a seed the whole
    answer equals kvmesh.LLM's."""
    prompt = random_prompt(BS + 7)
    params = SamplingParams(temperature=1.0, top_k=40, seed=4321, max_tokens=12, ignore_eos=True)
    ref = (await asyncio.to_thread(stack.reference.generate, [prompt], params))[0].outputs[0]
    tokens, text, _, _ = await disaggregated(stack, prompt, params)
    assert tokens == ref.token_ids
    assert text == ref.text


@pytest.mark.parametrize("stack", ["auto"], indirect=True)  # a second decode engine costs a model load
async def test_second_turn_hits_blocks_of_first_turns_decode_worker(stack: Stack):
    p1 = random_prompt(40)
    out1, _, _, _ = await disaggregated(stack, p1, greedy(26), decode=0)
    ref1 = (await asyncio.to_thread(stack.reference.generate, [p1], greedy(26)))[0].outputs[0]
    assert out1 == ref1.token_ids
    # Turn 2 = turn 1 + its answer + a new user message: 72 tokens; KV exists for 65 of turn 1's 66.
    p2 = p1 + out1 + random_prompt(6)
    hashes = stack.hashes(p2)
    assert len(hashes) == 4
    deadline = time.monotonic() + 5.0
    while True:  # the kvstore publishes to the index in batches
        holders = await stack.index.lookup(hashes)
        if all(stack.kvstore.address in h for h in holders) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    a, b = (await stack.decode(0)).address, (await stack.decode(1)).address
    pf, store = stack.prefill.address, stack.kvstore.address
    assert all(store in h for h in holders), holders
    # Blocks 2 and 3 hold generated text: only turn 1's decode worker computed them.
    assert all(a in h and pf not in h for h in holders[2:]), holders
    assert all(pf in h for h in holders[:2]), holders
    assert all(b not in h for h in holders)

    params = greedy(8)
    ref2 = (await asyncio.to_thread(stack.reference.generate, [p2], params))[0]
    chunks = [c async for c in (await stack.decode_stub(1)).Generate(pb.GenerateRequest(
        request_id="turn2", prompt_token_ids=p2, sampling=convert.sampling_to_proto(params), do_prefill=True,
        cached_blocks=[pb.BlockRef(hash=h, node=store) for h in hashes]))]
    assert chunks[0].num_cached_tokens == 4 * BS
    assert ref2.num_cached_tokens == 4 * BS  # the reference engine hit its own turn-1 blocks
    assert [t for c in chunks for t in c.token_ids] == ref2.outputs[0].token_ids
    assert "".join(c.text for c in chunks) == ref2.outputs[0].text
    # The same turn through the prefill worker: it has blocks 0-1 itself and pulls 2-3 from the store.
    tokens, text, reply, _ = await disaggregated(stack, p2, params, decode=0, cached=hashes)
    assert reply.num_cached_tokens == 4 * BS
    assert tokens == ref2.outputs[0].token_ids and text == ref2.outputs[0].text


async def test_cancelled_stream_frees_blocks(stack: Stack):
    engine = (await stack.decode(0)).runtime.engine
    base = await engine.run(lambda e: e.stats())
    assert base.num_running == 0
    params = convert.sampling_to_proto(greedy(200))
    prompt = random_prompt(3 * BS + 2)
    reply = await stack.prefill_stub().Prefill(pb.PrefillRequest(
        request_id="cancel-me", prompt_token_ids=prompt, sampling=params))
    call = (await stack.decode_stub(0)).Generate(pb.GenerateRequest(
        request_id="cancel-me", prompt_token_ids=prompt, sampling=params, prefilled=reply))
    got = 0
    async for chunk in call:
        got += len(chunk.token_ids)
        if got >= 3:
            break
    during = await engine.run(lambda e: e.stats())
    assert during.num_running == 1 and during.kv_cache_usage > base.kv_cache_usage
    call.cancel()
    deadline = time.monotonic() + 5.0
    while True:
        now = await engine.run(lambda e: (e.stats(), e.has_unfinished()))
        if (now[0].kv_cache_usage == base.kv_cache_usage and not now[1]) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    assert not now[1], "the request is still in the engine after cancel"
    assert now[0].kv_cache_usage == base.kv_cache_usage
    assert now[0].num_running == 0
    assert (await stack.decode(0)).runtime.pending == 0


@pytest.mark.parametrize("stack", ["auto"], indirect=True)
async def test_worker_at_capacity_refuses_with_resource_exhausted(stack: Stack):
    runtime = (await stack.decode(0)).runtime
    params = convert.sampling_to_proto(greedy(100))
    prompt = random_prompt(BS + 2)
    reply = await stack.prefill_stub().Prefill(pb.PrefillRequest(prompt_token_ids=prompt, sampling=params))
    runtime.max_pending = 1
    try:
        first = (await stack.decode_stub(0)).Generate(pb.GenerateRequest(
            prompt_token_ids=prompt, sampling=params, prefilled=reply))
        await first.read()  # running now
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [c async for c in (await stack.decode_stub(0)).Generate(pb.GenerateRequest(
                prompt_token_ids=prompt, sampling=params, prefilled=reply))]
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-pending-requests 1" in e.value.details()
        first.cancel()
    finally:
        runtime.max_pending = 256


@pytest.mark.parametrize("stack", ["auto"], indirect=True)
async def test_decode_recomputes_blocks_gone_from_store(stack: Stack):
    prompt = random_prompt(2 * BS + 3)
    params = greedy(5)
    ref = (await asyncio.to_thread(stack.reference.generate, [prompt], params))[0].outputs[0]
    sampling = convert.sampling_to_proto(params)
    reply = await stack.prefill_stub().Prefill(pb.PrefillRequest(
        request_id="gone", prompt_token_ids=prompt, sampling=sampling))
    # Handles the store does not hold (as if evicted after the prefill): the decode worker, which has
    # never seen this prompt, must recompute the prompt instead of failing.
    gone = pb.PrefillReply()
    gone.CopyFrom(reply)
    for b in gone.blocks:
        b.hash = random.randbytes(32)
    chunks = [c async for c in (await stack.decode_stub(1)).Generate(pb.GenerateRequest(
        request_id="gone", prompt_token_ids=prompt, sampling=sampling, prefilled=gone))]
    assert [reply.first_token] + [t for c in chunks for t in c.token_ids] == ref.token_ids


@pytest.mark.parametrize("stack", ["auto"], indirect=True)
async def test_decode_asks_the_store_for_no_block_the_prefill_worker_could_not_put(stack: Stack):
    prompt, params = random_prompt(2 * BS + 5), greedy(4)
    ref = (await asyncio.to_thread(stack.reference.generate, [prompt], params))[0].outputs[0]
    sampling = convert.sampling_to_proto(params)
    reply = await stack.prefill_stub().Prefill(pb.PrefillRequest(
        request_id="unstored", prompt_token_ids=prompt, sampling=sampling))
    reply.blocks[1].node = ""  # as a failed put leaves it: the second block and what follows stay unasked
    registry = (await stack.decode(1)).runtime.metrics.registry
    asked = lambda: sum(registry.get_sample_value("kvmesh:worker_blocks_total", {"op": op}) or 0  # noqa: E731
                        for op in ("pulled", "missing"))
    before = asked()
    chunks = [c async for c in (await stack.decode_stub(1)).Generate(pb.GenerateRequest(
        request_id="unstored", prompt_token_ids=prompt, sampling=sampling, prefilled=reply))]
    assert [reply.first_token] + [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert asked() - before == 1  # the first block only


@pytest.mark.parametrize("stack", ["auto"], indirect=True)
async def test_concurrent_requests_each_get_their_own_stream(stack: Stack):
    prompts = [random_prompt(n) for n in (BS + 3, 2 * BS + 7, 3 * BS)]
    lengths = [4, 7, 5]
    results = await asyncio.gather(*(disaggregated(stack, p, greedy(n)) for p, n in zip(prompts, lengths)))
    for p, n, (tokens, text, reply, chunks) in zip(prompts, lengths, results):
        assert len(tokens) == n and chunks[-1].finish_reason == "length"
        assert reply.tail.num_tokens == len(p) % BS and len(reply.blocks) == len(p) // BS
    engine = (await stack.decode(0)).runtime.engine
    assert not await engine.run(lambda e: e.has_unfinished())


@pytest.mark.parametrize("stack", ["auto"], indirect=True)
async def test_short_prompt_with_do_prefill(stack: Stack):
    prompt = random_prompt(6)
    params = dataclasses.replace(greedy(6), logprobs=2)
    ref = (await asyncio.to_thread(stack.reference.generate, [prompt], params))[0].outputs[0]
    chunks = [c async for c in (await stack.decode_stub(1)).Generate(pb.GenerateRequest(
        request_id="short", prompt_token_ids=prompt, sampling=convert.sampling_to_proto(params),
        do_prefill=True))]
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    lps = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in lps] == ref.token_ids
    assert all(len(lp.top) == 2 for lp in lps)
    assert chunks[0].num_prompt_tokens == 6 and chunks[0].num_cached_tokens == 0


@pytest.mark.parametrize("stack", ["auto"], indirect=True)
async def test_health_metrics_and_bad_requests(stack: Stack):
    await disaggregated(stack, random_prompt(40), greedy(2))  # a prefill hop: the decode worker pulls its pages
    for ch in stack.channels:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    port = (await stack.decode(0)).runtime.metrics_port
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            body = await resp.text()
    assert resp.status == 200
    assert "kvmesh:e2e_request_latency_seconds" in body and "kvmesh:kv_cache_usage_perc" in body
    pulled = [ln for ln in body.splitlines() if ln.startswith('kvmesh:worker_blocks_total{op="pulled"}')]
    assert pulled and float(pulled[0].split()[-1]) > 0  # the prefilled prompt's blocks came from the store
    imports = [ln for ln in body.splitlines() if ln.startswith('kvmesh:worker_imports_total{path="in_process"}')]
    assert imports and float(imports[0].split()[-1]) > 0  # engines on a thread here
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stack.prefill_stub().Prefill(pb.PrefillRequest(
            prompt_token_ids=[1, 2], sampling=pb.SamplingParams(temperature=-1.0)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stack.prefill_stub().Prefill(pb.PrefillRequest(
            prompt_token_ids=random_prompt(MAX_MODEL_LEN + 1), sampling=pb.SamplingParams(max_tokens=4)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max-model-len" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _ = [c async for c in (await stack.decode_stub(0)).Generate(pb.GenerateRequest(
            prompt_token_ids=random_prompt(20), sampling=pb.SamplingParams(max_tokens=4)))]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefilled" in e.value.details()
    # A tail in another dtype would corrupt the residual slot inside the engine step: refused up front.
    prompt = random_prompt(BS + 1)
    sampling = pb.SamplingParams(max_tokens=3)
    reply = await stack.prefill_stub().Prefill(pb.PrefillRequest(prompt_token_ids=prompt, sampling=sampling))
    reply.tail.dtype = "fp16"
    reply.tail.data = reply.tail.data[:len(reply.tail.data) // 2]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _ = [c async for c in (await stack.decode_stub(0)).Generate(pb.GenerateRequest(
            prompt_token_ids=prompt, sampling=sampling, prefilled=reply))]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tail.dtype" in e.value.details()
    # One server span per call, with what the worker did.
    spans = stack.spans.get_finished_spans()
    prefill = [sp for sp in spans if sp.name == "kvmesh.prefill/Prefill"]
    decode = [sp for sp in spans if sp.name == "kvmesh.decode/Generate"]
    assert any(sp.attributes.get("kvmesh.pushed_blocks", 0) > 0 for sp in prefill)
    assert any(sp.attributes.get("kvmesh.pulled_blocks", 0) > 0 for sp in decode)
    assert any(not sp.status.is_ok for sp in decode)  # the rejected call is marked failed


@pytest.mark.parametrize("stack", ["auto"], indirect=True)
async def test_a_paced_stream_carries_several_tokens_a_message(stack: Stack):
    """--max-chunk-rate shared by one stream: its first token goes out at once, later messages carry
    what several steps made, and the stream (tokens, text, logprobs) is the unpaced one."""
    prompt = random_prompt(6)
    params = dataclasses.replace(greedy(24), logprobs=1)
    ref = (await asyncio.to_thread(stack.reference.generate, [prompt], params))[0].outputs[0]
    servicer = (await stack.decode(1)).servicer
    servicer.max_chunk_rate = 2  # one stream: a message every 0.5 s, several steps even on a loaded CPU
    try:
        chunks = [c async for c in (await stack.decode_stub(1)).Generate(pb.GenerateRequest(
            request_id="paced", prompt_token_ids=prompt, sampling=convert.sampling_to_proto(params),
            do_prefill=True))]
    finally:
        servicer.max_chunk_rate = DecodeConfig.max_chunk_rate
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    assert [lp.token_id for c in chunks for lp in c.logprobs] == ref.token_ids
    assert len(chunks[0].token_ids) == 1 and chunks[-1].finish_reason == "length"
    assert len(chunks) < len(ref.token_ids) / 2
    assert servicer.streaming == 0
