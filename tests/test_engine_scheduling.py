"""Scheduling on a tiny random model: prefix caching (counters), preemption under a small KV budget,
bad input (clear errors, other requests unaffected), pool-size limits, abort, --max-model-len."""
from __future__ import annotations

import pytest
import torch

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from test_engine_models import PAGE, run_to_completion, make_tiny_model, random_prompts

torch.set_num_threads(1)  # 2 shared cores: more threads only add contention
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(d, "llama", seed=3)
    return str(d)


def make(model_dir, blocks=512, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, device="cpu",
                                  cache=CacheConfig(kv_cache_memory=blocks * PAGE),
                                  scheduler=SchedulerConfig(**sched)))


def drain(eng: LLMEngine) -> dict:
    return run_to_completion(eng)


def test_repeated_prompt_computes_only_its_tail(model_dir):
    eng = make(model_dir)
    prompt = random_prompts(1, 50, 50, seed=5)[0]  # 3 full blocks + 2 tokens
    eng.add_request("a", prompt, GREEDY)
    first = drain(eng)["a"]
    s0 = eng.stats()
    assert first.num_cached_tokens == 0 and s0.prefix_cache_hits == 0
    assert s0.computed_tokens == 50 + GREEDY.max_tokens - 1
    eng.add_request("b", prompt, GREEDY)
    second = drain(eng)["b"]
    s1 = eng.stats()
    assert second.num_cached_tokens == 48
    assert s1.prefix_cache_queries - s0.prefix_cache_queries == 50
    assert s1.prefix_cache_hits - s0.prefix_cache_hits == 48
    assert s1.computed_tokens - s0.computed_tokens == 2 + GREEDY.max_tokens - 1
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # the salt separates tenants: same tokens, no hit
    eng.add_request("c", prompt, GREEDY, cache_salt="tenant-2")
    assert drain(eng)["c"].num_cached_tokens == 0


def test_prefix_caching_off(model_dir):
    eng = LLMEngine(EngineConfig(model=model_dir, device="cpu",
                                 cache=CacheConfig(kv_cache_memory=64 * PAGE, enable_prefix_caching=False)))
    prompt = random_prompts(1, 40, 40, seed=6)[0]
    for rid in ("a", "b"):
        eng.add_request(rid, prompt, GREEDY)
        assert drain(eng)[rid].num_cached_tokens == 0
    assert eng.stats().prefix_cache_hits == 0


def test_32_requests_under_a_small_budget_match_an_unconstrained_run(model_dir):
    prompts = random_prompts(32, 5, 40, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = make(model_dir, blocks=1024, max_num_seqs=32, max_num_batched_tokens=2048)
    for i, p in enumerate(prompts):
        big.add_request(f"r{i}", p, params)
    ref = drain(big)
    assert big.stats().num_preemptions == 0
    small = make(model_dir, blocks=24, max_num_seqs=32, max_num_batched_tokens=256)
    for i, p in enumerate(prompts):
        small.add_request(f"r{i}", p, params)
    got = drain(small)
    st = small.stats()
    assert st.num_preemptions > 0
    assert st.kv_cache_usage == 0.0 and st.num_running == 0 and st.num_waiting == 0
    assert len(got) == 32
    for i in range(32):
        assert got[f"r{i}"].outputs[0].token_ids == ref[f"r{i}"].outputs[0].token_ids, i
        assert got[f"r{i}"].outputs[0].finish_reason == "length"


def test_bad_input_names_the_field_and_spares_the_batch(model_dir):
    eng = make(model_dir, max_model_len=64)
    good = random_prompts(2, 20, 20, seed=8)
    alone = make(model_dir, max_model_len=64)
    alone.add_request("g0", good[0], GREEDY)
    ref = drain(alone)["g0"].outputs[0].token_ids

    eng.add_request("g0", good[0], GREEDY)
    eng.step()
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        eng.add_request("bad1", [], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids.*--max-model-len 64"):
        eng.add_request("bad2", [1] * 64, GREEDY)
    with pytest.raises(ValueError, match="max_tokens.*--max-model-len 64"):
        eng.add_request("bad3", [1] * 50, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="^temperature"):
        eng.add_request("bad4", good[1], SamplingParams(temperature=-0.5))
    with pytest.raises(ValueError, match="^top_p"):
        eng.add_request("bad5", good[1], SamplingParams(top_p=2.0))
    with pytest.raises(ValueError, match="prompt_token_ids.*vocabulary"):
        eng.add_request("bad6", [1, 2, 100000], GREEDY)
    with pytest.raises(ValueError, match="request_id 'g0'"):
        eng.add_request("g0", good[1], GREEDY)
    out = drain(eng)
    assert set(out) == {"g0"}
    assert out["g0"].outputs[0].token_ids == ref


def test_request_that_can_never_fit_is_refused(model_dir):
    eng = make(model_dir, blocks=4)
    with pytest.raises(ValueError, match="max_tokens.*--kv-cache-memory"):
        eng.add_request("x", [1] * 40, SamplingParams(max_tokens=40))
    eng.add_request("y", [1] * 20, SamplingParams(max_tokens=20, temperature=0.0))  # 40 tokens fit
    assert len(drain(eng)["y"].outputs[0].token_ids) == 20


def test_abort_frees_blocks_at_once(model_dir):
    eng = make(model_dir, max_num_batched_tokens=16)
    eng.add_request("a", random_prompts(1, 60, 60, seed=9)[0], GREEDY)
    eng.add_request("b", random_prompts(1, 30, 30, seed=10)[0], GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.stats().kv_cache_usage > 0
    eng.abort("a")
    eng.abort("b")
    eng.kv.check_integrity()
    assert eng.stats().kv_cache_usage == 0.0 and not eng.has_unfinished()
    assert eng.step() == []


def test_max_model_len_ends_with_length(model_dir):
    eng = make(model_dir, max_model_len=40)
    eng.add_request("a", [5] * 30, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    out = drain(eng)["a"].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_mixed_requests_under_preemption_match_an_unconstrained_run(model_dir):
    """n > 1 (forked), seeded sampling, stop strings, logprobs and prompt_logprobs, all preempted
    and recomputed: every completion equals the unconstrained run's; integrity holds every step."""
    prompts = random_prompts(16, 5, 50, seed=11)

    def params(i: int) -> SamplingParams:
        return [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                SamplingParams(n=3, temperature=0.0, max_tokens=25, ignore_eos=True),
                SamplingParams(n=2, temperature=0.9, seed=i, max_tokens=20, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=30, stop=["a"], prompt_logprobs=1,
                               logprobs=2)][i % 4]

    def go(blocks: int):
        eng = make(model_dir, blocks=blocks, max_num_seqs=16, max_num_batched_tokens=64)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params(i))
        final = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o
            eng.kv.check_integrity()
        return final, eng.stats()

    ref, s0 = go(1024)
    got, s1 = go(14)
    assert s0.num_preemptions == 0 and s1.num_preemptions > 0 and s1.kv_cache_usage == 0.0
    for rid, r in ref.items():
        assert [c.token_ids for c in got[rid].outputs] == [c.token_ids for c in r.outputs], rid
        assert [c.text for c in got[rid].outputs] == [c.text for c in r.outputs], rid
        if r.prompt_logprobs is not None:
            assert [p.token_id for p in got[rid].prompt_logprobs[1:]] == [p.token_id for p in r.prompt_logprobs[1:]]


def _batching(eng: LLMEngine, wait_steps: int) -> list:
    """Turns on the GPU's prefill batching (`SchedulerLimits.batch_prefills`) on a CPU engine and
    records each step's tokens a sequence."""
    import dataclasses
    eng.scheduler.limits = dataclasses.replace(eng.scheduler.limits, batch_prefills=True,
                                               prefill_wait_steps=wait_steps)
    steps, schedule = [], eng.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append(list(out.num_new))
        return out
    eng.scheduler.schedule = recorded
    return steps


def test_batched_prefills_hold_a_lone_prompt_then_admit_it(model_dir):
    """With 16 sequences decoding, one new prompt waits (admitting it alone would cost an eager step)
    until prefill_wait_steps have passed; four new prompts (16 // 4) go in at once; the tokens are
    those of an engine that admits at once."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = random_prompts(21, 8, 20, seed=11)
    ref = make(model_dir, max_num_seqs=32)
    for i, p in enumerate(prompts):
        ref.add_request(f"r{i}", p, params)
    want = drain(ref)
    eng = make(model_dir, max_num_seqs=32)
    steps = _batching(eng, wait_steps=5)
    got = {}

    def step():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o
    for i in range(16):
        eng.add_request(f"r{i}", prompts[i], params)
    step()  # nothing decodes yet: all 16 admitted together
    assert len(steps[-1]) == 16 and eng.stats().num_running == 16
    eng.add_request("r16", prompts[16], params)
    for _ in range(5):
        step()
        assert steps[-1] == [1] * 16 and eng.stats().num_waiting == 1  # held: 16 // 4 wanted
    step()  # the sixth step: held long enough
    assert steps[-1][:16] == [1] * 16 and steps[-1][16] == len(prompts[16])
    for i in range(17, 21):
        eng.add_request(f"r{i}", prompts[i], params)
    step()  # four admissible at once (17 // 4 wanted): in
    assert steps[-1][-4:] == [len(p) for p in prompts[17:]]
    while eng.has_unfinished():
        step()
    eng.kv.check_integrity()
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in want.items()}


def test_batched_prefills_cut_mixed_steps_under_load(model_dir):
    import dataclasses

    """32 requests of different lengths through 16 seats on a small pool: with batching, fewer steps
    mix prompts into running decodes (each would be an eager step on a GPU), and the tokens are
    unchanged."""
    prompts = random_prompts(32, 10, 40, seed=12)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 7 * i % 40, ignore_eos=True) for i in range(32)]

    def run(batch: bool):
        eng = make(model_dir, blocks=64, max_num_seqs=16, max_num_batched_tokens=512)
        steps = _batching(eng, wait_steps=32)
        if not batch:  # recorded the same way, admitted at once
            eng.scheduler.limits = dataclasses.replace(eng.scheduler.limits, batch_prefills=False)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"r{i}", p, sp)
        out = drain(eng)
        mixed = sum(1 for s in steps if 1 in s and max(s) > 1)
        return {r: o.outputs[0].token_ids for r, o in out.items()}, mixed
    (plain, plain_mixed), (batched, batched_mixed) = run(False), run(True)
    assert batched == plain and len(plain) == 32
    print(f"steps mixing prompts into decodes: {plain_mixed} admitted at once, {batched_mixed} batched")
    assert batched_mixed < plain_mixed, (batched_mixed, plain_mixed)


def test_growth_reserve_spares_preemptions(model_dir):
    """Admitting only where a free page stays for each running sequence's next block (the default)
    preempts less than admitting whatever fits now, on the same small pool, with the same tokens."""
    import dataclasses
    prompts = random_prompts(32, 5, 40, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(reserve: bool):
        eng = make(model_dir, blocks=24, max_num_seqs=32, max_num_batched_tokens=256)
        assert eng.scheduler.limits.growth_reserve
        eng.scheduler.limits = dataclasses.replace(eng.scheduler.limits, growth_reserve=reserve)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        out = drain(eng)
        return {r: o.outputs[0].token_ids for r, o in out.items()}, eng.stats().num_preemptions
    (plain, plain_pre), (kept, kept_pre) = run(False), run(True)
    print(f"preemptions: {plain_pre} without the reserve, {kept_pre} with it")
    assert kept == plain and len(kept) == 32
    assert kept_pre < plain_pre
