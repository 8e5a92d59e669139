"""Sampling through the whole engine on a tiny random model (and SmolLM2 for EOS handling): seeds,
stop strings and stop ids, min_tokens / ignore_eos, logprobs and prompt_logprobs against
transformers' logits, penalties as defined, n > 1 sharing the prompt's pages."""
from __future__ import annotations

import pytest
import torch

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.outputs import OutputKind
from kvmesh.engine.sampling_params import SamplingParams
from test_engine_models import run_to_completion, hf_logits, make_tiny_model, random_prompts

torch.set_num_threads(1)  # 2 shared cores: more threads only add contention


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    hf = make_tiny_model(d, "llama", seed=21)
    return str(d), hf


def make(model: str, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", cache=CacheConfig(kv_cache_memory=4 << 20),
                                  scheduler=SchedulerConfig(**sched)))


def run(eng: LLMEngine, reqs: dict) -> dict:
    for rid, (prompt, params) in reqs.items():
        eng.add_request(rid, prompt, params)
    return run_to_completion(eng)


def test_seed_reproducible_and_independent_of_the_batch(tiny):
    model, _ = tiny
    p = random_prompts(3, 10, 30, seed=1)
    sp = lambda seed: SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=20, ignore_eos=True)
    a = run(make(model), {"x": (p[0], sp(7))})["x"].outputs[0].token_ids
    b = run(make(model), {"x": (p[0], sp(7)), "y": (p[1], sp(None)), "z": (p[2], sp(3))})
    assert b["x"].outputs[0].token_ids == a
    c = run(make(model), {"x": (p[0], sp(8))})["x"].outputs[0].token_ids
    assert c != a


def test_stop_strings_cut_the_text(tiny):
    model, _ = tiny
    eng = make(model)
    prompt = random_prompts(1, 12, 12, seed=2)[0]
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = run(eng, {"a": (prompt, base)})["a"].outputs[0]
    text = full.text
    stop = text[12:14]
    cut = text.find(stop)
    out = run(eng, {"b": (prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                  stop=[stop]))})["b"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    out = run(eng, {"c": (prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True))})["c"].outputs[0]
    assert out.text == text[:cut + len(stop)]


def test_stop_token_ids_and_min_tokens(tiny):
    model, _ = tiny
    eng = make(model)
    prompt = random_prompts(1, 12, 12, seed=3)[0]
    full = run(eng, {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))})
    toks = full["a"].outputs[0].token_ids
    t = toks[2]
    first = toks.index(t)
    out = run(eng, {"b": (prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[t]))})
    o = out["b"].outputs[0]
    assert o.token_ids == toks[:first + 1] and o.finish_reason == "stop" and o.stop_reason == t
    out = run(eng, {"c": (prompt, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=first + 3,
                                                  stop_token_ids=[t]))})
    o = out["c"].outputs[0]
    assert t not in o.token_ids[:first + 3] and len(o.token_ids) >= first + 3


def test_logprobs_match_log_softmax_of_transformers_logits(tiny):
    model, hf = tiny
    prompt = random_prompts(1, 20, 20, seed=4)[0]
    out = run(make(model), {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=12, logprobs=3,
                                                         ignore_eos=True))})["a"].outputs[0]
    ref = torch.log_softmax(hf_logits(hf, prompt + out.token_ids), -1)  # [P + N, V]
    assert len(out.logprobs) == 12
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i] == int(row.argmax())
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


def test_prompt_logprobs_match_transformers_and_skip_the_cache(tiny):
    model, hf = tiny
    eng = make(model, max_num_batched_tokens=16)  # the prompt is computed in chunks
    prompt = random_prompts(1, 45, 45, seed=5)[0]
    run(eng, {"warm": (prompt, SamplingParams(max_tokens=2))})  # its blocks are now cached
    o = run(eng, {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))})["a"]
    assert o.num_cached_tokens == 0
    ref = torch.log_softmax(hf_logits(hf, prompt), -1)  # [P, V]
    assert len(o.prompt_logprobs) == len(prompt) and o.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        lp = o.prompt_logprobs[p]
        assert lp.token_id == prompt[p]
        assert lp.logprob == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[p - 1].topk(2).indices.tolist()


@pytest.mark.parametrize("kind", ["frequency", "presence", "repetition"])
def test_penalties_change_greedy_choice_as_defined(tiny, kind):
    model, hf = tiny
    prompt = random_prompts(1, 10, 10, seed=6)[0]
    kw = {"frequency": dict(frequency_penalty=1.5), "presence": dict(presence_penalty=1.5),
          "repetition": dict(repetition_penalty=1.8)}[kind]
    out = run(make(model), {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                         **kw))})["a"].outputs[0].token_ids
    plain = run(make(model), {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=16,
                                                           ignore_eos=True))})["a"].outputs[0].token_ids
    logits = hf_logits(hf, prompt + out)
    for i, tok in enumerate(out):
        row = logits[len(prompt) - 1 + i].clone()
        prev = out[:i]
        counts = torch.bincount(torch.tensor(prev, dtype=torch.long), minlength=row.numel()).float()
        if kind == "frequency":
            row -= 1.5 * counts
        elif kind == "presence":
            row -= 1.5 * (counts > 0).float()
        else:
            seen = torch.tensor(sorted(set(prompt + prev)))
            row[seen] = torch.where(row[seen] > 0, row[seen] / 1.8, row[seen] * 1.8)
        assert tok == int(row.argmax()), i
    assert out != plain  # the penalty bit


def test_n_completions_share_the_prompt_pages(tiny):
    model, _ = tiny
    eng = make(model)
    prompt = random_prompts(1, 40, 40, seed=7)[0]  # 2 full blocks + 8 tokens in the residual slot
    eng.add_request("x", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))
    outs = eng.step()  # prefill, fork, first tokens
    seqs = list(eng.scheduler.running)
    assert len(seqs) == 3 and len(outs[0].outputs) == 3
    assert seqs[0].block_ids == seqs[1].block_ids == seqs[2].block_ids and len(seqs[0].block_ids) == 2
    assert all(eng.kv.pool.blocks[b].ref_cnt == 3 for b in seqs[0].block_ids)
    assert eng.stats().kv_cache_usage == pytest.approx(2 / eng.kv.num_blocks)
    final = None
    while eng.has_unfinished():
        for o in eng.step():
            final = o
    eng.kv.check_integrity()
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    toks = [c.token_ids for c in final.outputs]
    assert all(len(t) == 12 for t in toks) and len({tuple(t) for t in toks}) == 3
    again = run(make(model), {"x": (prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12,
                                                           ignore_eos=True))})["x"]
    assert [c.token_ids for c in again.outputs] == toks
    greedy = run(make(model), {"g": (prompt, SamplingParams(n=2, temperature=0.0, max_tokens=8,
                                                            ignore_eos=True))})["g"]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


@pytest.fixture(scope="module")
def smollm2():
    return make("smollm2", max_num_seqs=4)


def test_eos_ends_and_ignore_eos_and_min_tokens_hold_it_off(smollm2):
    eng = smollm2
    tok = eng.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hello."}]),
                        add_special_tokens=False)
    eos = set(tok.eos_token_ids)
    o = run(eng, {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=48))})["a"].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] in eos and o.stop_reason is None
    n = len(o.token_ids)
    o2 = run(eng, {"b": (prompt, SamplingParams(temperature=0.0, max_tokens=n + 2, ignore_eos=True))})["b"].outputs[0]
    assert o2.finish_reason == "length" and o2.token_ids[:n] == o.token_ids and len(o2.token_ids) == n + 2
    o3 = run(eng, {"c": (prompt, SamplingParams(temperature=0.0, max_tokens=n + 6, min_tokens=n + 2))})["c"].outputs[0]
    assert len(o3.token_ids) >= n + 2 and not eos & set(o3.token_ids[:n + 2])
    assert o3.token_ids[:n - 1] == o.token_ids[:n - 1]


def test_output_kinds_carry_the_same_completions(tiny):
    # a stream of DELTA outputs adds up to the CUMULATIVE completion (tokens, text held back for a
    # stop string, logprobs; prompt logprobs once); FINAL_ONLY reports once, at the end
    model, _ = tiny
    prompts = random_prompts(2, 10, 20, seed=9)
    full = run(make(model), {"a": (prompts[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))})
    stop = full["a"].outputs[0].text[9:12]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=1,
                             prompt_logprobs=1),
              SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=12, ignore_eos=True)]
    seen = {}
    for kind in OutputKind:
        eng = make(model, max_num_batched_tokens=16)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"r{i}", p, sp, output_kind=kind)
        seen[kind] = {"r0": [], "r1": []}
        while eng.has_unfinished():
            for o in eng.step():
                seen[kind][o.request_id].append(o)
    for rid in ("r0", "r1"):
        cumulative, deltas, final = (seen[k][rid] for k in OutputKind)
        want = cumulative[-1]
        assert len(final) == 1 and final[0].finished and final[0].outputs == want.outputs
        assert final[0].prompt_logprobs == want.prompt_logprobs
        assert len(deltas) == len(cumulative) and deltas[-1].finished
        for c in want.outputs:
            parts = [d.outputs[c.index] for d in deltas]
            assert [t for d in parts for t in d.token_ids] == c.token_ids
            assert "".join(d.text for d in parts) == c.text
            assert parts[-1].finish_reason == c.finish_reason
            if c.logprobs is not None:
                assert [lp for d in parts for lp in d.logprobs] == c.logprobs
        lps = [d.prompt_logprobs for d in deltas]
        assert lps[0] == want.prompt_logprobs and all(x is None for x in lps[1:])
    assert seen[OutputKind.CUMULATIVE]["r0"][-1].outputs[0].finish_reason == "stop"
    assert len(seen[OutputKind.CUMULATIVE]["r1"][-1].outputs) == 2
