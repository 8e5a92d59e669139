"""Scheduling on a tiny random model: prefix caching (counters), preemption under a small KV budget,
bad input (clear errors, other requests unaffected), pool-size limits, abort, --max-model-len."""
from __future__ import annotations

import pytest
import torch

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling_params import SamplingParams
from test_engine_models import run_to_completion, make_tiny_model, random_prompts

torch.set_num_threads(1)  # 2 shared cores: more threads only add contention
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PAGE = 2 * 2 * 2 * 16 * 16 * 4  # tiny model page: layers * K,V * kv_heads * block * head_dim * fp32


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
