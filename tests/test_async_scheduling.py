"""Async scheduling (`engine/inflight.py`) on a tiny random model on the CPU: each step launched
before the last one's tokens are read back must give exactly what the synchronous engine gives
(greedy and seeded draws, logprobs, logit bias, min_tokens, penalties counting the token in flight,
stop tokens and strings found a step late, n > 1 forked at launch, preemption, aborts),
free every page, and compute no row for a sequence that its step in flight ends by length."""
from __future__ import annotations

import pytest
import torch

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.outputs import OutputKind
from kvmesh.engine.sampling_params import SamplingParams
from test_engine_models import PAGE, make_tiny_model, random_prompts, run_to_completion

torch.set_num_threads(1)  # 2 shared cores: more threads only add contention


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny_model(d, "llama", seed=11)
    return str(d)


def make(model_dir: str, async_scheduling: bool, blocks: int = 512, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, device="cpu", cache=CacheConfig(kv_cache_memory=blocks * PAGE),
                                  scheduler=SchedulerConfig(async_scheduling=async_scheduling, **sched)))


def run(eng: LLMEngine, reqs: dict, kind: OutputKind = OutputKind.CUMULATIVE) -> dict:
    for rid, (prompt, params) in reqs.items():
        eng.add_request(rid, prompt, params, output_kind=kind)
    return run_to_completion(eng)


def summary(outs: dict) -> dict:
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                   None if c.logprobs is None else [(t.token_id, round(t.logprob, 4), [i for i, _ in t.top])
                                                    for t in c.logprobs])
                  for c in o.outputs] for rid, o in outs.items()}


def mixed_requests(model_dir: str) -> dict:
    """Greedy, seeded draws, stop ids and strings taken from a plain run's outputs, n = 2, logprobs."""
    prompts = random_prompts(10, 4, 40, seed=3)
    greedy = lambda n, **kw: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    plain = run(make(model_dir, False), {f"p{i}": (p, greedy(30)) for i, p in enumerate(prompts[:4])})
    stop_id = plain["p0"].outputs[0].token_ids[7]
    stop_str = plain["p1"].outputs[0].text[10:13]
    return {
        "g0": (prompts[0], greedy(30, stop_token_ids=[stop_id])),
        "g1": (prompts[1], greedy(30, stop=[stop_str])),
        "g2": (prompts[2], greedy(5)),
        "g3": (prompts[3], greedy(23)),
        "s0": (prompts[4], SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=17, ignore_eos=True)),
        "s1": (prompts[5], SamplingParams(temperature=1.2, top_k=20, seed=5, max_tokens=9, ignore_eos=True)),
        "n2": (prompts[6], SamplingParams(n=2, temperature=1.0, seed=6, max_tokens=11, ignore_eos=True)),
        "lp": (prompts[7], greedy(12, logprobs=2)),
        "one": (prompts[8], SamplingParams(temperature=0.7, seed=9, max_tokens=1, logprobs=0)),
        "long": (prompts[9], greedy(40, logit_bias={stop_id: 3.0, 7: -100.0})),
        "min": (prompts[0], SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12,
                                           stop_token_ids=[stop_id], logprobs=1)),
        "pen": (prompts[5], greedy(14, repetition_penalty=1.3)),
        "pf": (prompts[2], SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True,
                                          presence_penalty=0.7, frequency_penalty=0.4)),
    }


def test_async_steps_give_what_synchronous_steps_give(model_dir):
    reqs = mixed_requests(model_dir)
    want = run(make(model_dir, False), reqs)
    eng = make(model_dir, True)
    got = run(eng, reqs)
    assert summary(got) == summary(want)
    assert got["g0"].outputs[0].finish_reason == "stop" and got["g1"].outputs[0].finish_reason == "stop"
    st = eng.stats()
    assert len(got["min"].outputs[0].token_ids) >= 12 and len(got["lp"].outputs[0].logprobs[0].top) == 2
    assert st.async_steps > 10
    assert st.kv_cache_usage == 0.0 and st.num_running == 0 and st.num_waiting == 0
    assert eng.has_unfinished() is False


def test_every_step_runs_ahead(model_dir):
    reqs = mixed_requests(model_dir)
    eng = make(model_dir, True)
    for rid, (prompt, params) in reqs.items():
        eng.add_request(rid, prompt, params)
    steps, computed = 0, 0
    while eng.has_unfinished():
        eng.step()
        steps += eng.stats().computed_tokens != computed
        computed = eng.stats().computed_tokens
    assert eng.stats().async_steps == steps > 10


def test_deltas_add_up_to_the_completion(model_dir):
    prompts = random_prompts(3, 5, 30, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    want = run(make(model_dir, False), {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    eng = make(model_dir, True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params, output_kind=OutputKind.DELTA)
    toks: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    text = {k: "" for k in toks}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.outputs[0].token_ids
            text[o.request_id] += o.outputs[0].text
    for rid, o in want.items():
        assert toks[rid] == o.outputs[0].token_ids and text[rid] == o.outputs[0].text


def test_length_ends_compute_no_extra_row_and_stops_at_most_one(model_dir):
    prompts = random_prompts(6, 5, 35, seed=9)
    by_length = {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True))
                 for i, p in enumerate(prompts)}
    sync, asyn = make(model_dir, False), make(model_dir, True)
    assert summary(run(asyn, by_length)) == summary(run(sync, by_length))
    assert asyn.stats().computed_tokens == sync.stats().computed_tokens
    # stops found a step late: each costs at most the one row its next step had already launched
    first = run(make(model_dir, False), by_length)
    stops = {rid: (p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                     stop_token_ids=[first[rid].outputs[0].token_ids[4]]))
             for rid, (p, _) in by_length.items()}
    sync, asyn = make(model_dir, False), make(model_dir, True)
    want, got = run(sync, stops), run(asyn, stops)
    assert summary(got) == summary(want)
    extra = asyn.stats().computed_tokens - sync.stats().computed_tokens
    assert 0 <= extra <= len(stops)


def test_preemption_and_aborts_while_a_step_is_in_flight(model_dir):
    prompts = random_prompts(24, 5, 40, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reqs = {f"r{i}": (p, params) for i, p in enumerate(prompts)}
    want = run(make(model_dir, False, blocks=1024, max_num_seqs=24), reqs)
    small = make(model_dir, True, blocks=20, max_num_seqs=24, max_num_batched_tokens=256)
    got = run(small, reqs)
    st = small.stats()
    assert st.num_preemptions > 0 and st.async_steps > 0
    assert summary(got) == summary(want)
    assert st.kv_cache_usage == 0.0
    # aborts between steps, with a step of the aborted request in flight
    eng = make(model_dir, True, max_num_seqs=8)
    for rid in ("r0", "r1", "r2", "r3"):
        eng.add_request(rid, *reqs[rid])
    finals = {}
    for i in range(40):
        if i == 6:
            assert eng._inflight is not None and any(s.request.request_id == "r1" for s in eng._inflight.seqs)
            eng.abort("r1")
        if i == 9:
            eng.abort("r2")
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
        if not eng.has_unfinished():
            break
    eng.kv.check_integrity()
    assert set(finals) == {"r0", "r3"} and eng.stats().kv_cache_usage == 0.0
    assert summary(finals) == summary({k: want[k] for k in finals})
