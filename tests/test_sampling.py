"""Sampler and SamplingParams on fresh random logits: exact definitions, no model needed."""
from __future__ import annotations

import math

import pytest
import torch

from kvmesh.engine.sampler import SampleRow, Sampler, apply_penalties
from kvmesh.engine.sampling_params import SamplingParams

V = 97


def _row(**kw) -> SampleRow:
    prompt = kw.pop("prompt", [1, 2, 3])
    out = kw.pop("out", [])
    gen = kw.pop("generator", None)
    banned = kw.pop("banned", ())
    return SampleRow(SamplingParams(**kw), prompt + out, len(prompt), gen, banned)


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("min_tokens", -1), ("n", 0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("logprobs", 21), ("prompt_logprobs", -1),
    ("stop", [""]), ("stop_token_ids", [-3]), ("logit_bias", {3: 101.0}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"3": 1.0}),
])
def test_validate_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value}).validate()


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="^min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5).validate()


def test_greedy_is_argmax_and_logprobs_match_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(5, V) * 3
    s = Sampler(0, torch.device("cpu"))
    res = s(logits, [_row(temperature=0.0, logprobs=3) for _ in range(5)])
    assert res.token_ids == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(res.logprobs):
        assert lp.token_id == res.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-6)
        top = ref[i].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)


@pytest.mark.parametrize("native", [False, True])
def test_bf16_logits_sample_as_their_float32_copy(native):
    """The runner hands the sampler model-dtype logits: greedy rows (the fast path, with the C
    argmax or torch) and mixed rows (penalties, logprobs) give what float32 copies give."""
    from kvmesh.kernels.cpu_native import load
    kernels = load() if native else None
    if native and kernels is None:
        pytest.skip("no C compiler: the native kernels could not be built")
    torch.manual_seed(3)
    logits = (torch.randn(6, V) * 3).bfloat16()
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a bf16 tie: the first index wins
    s = Sampler(0, torch.device("cpu"), kernels)
    greedy = [_row(temperature=0.0) for _ in range(6)]
    assert s(logits, greedy).token_ids == s(logits.float(), greedy).token_ids == logits.float().argmax(-1).tolist()
    mixed = greedy[:3] + [_row(temperature=0.0, logprobs=2), _row(temperature=0.0, repetition_penalty=1.3),
                          _row(temperature=0.0, logprobs=0)]
    a, b = s(logits, mixed), s(logits.float(), mixed)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    torch.manual_seed(2)
    logits = torch.randn(1, V)
    s = Sampler(0, torch.device("cpu"))

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return [s(logits, [_row(temperature=1.0, generator=g, out=[0] * i)]).token_ids[0] for i in range(30)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    assert len(set(draw(7))) > 1  # each position draws afresh


def test_seeded_draw_depends_only_on_seed_and_position():
    """No state carried between draws: position i's token is the same whether or not positions
    0..i-1 were drawn by this generator (a resumed or recomputed sequence draws what one engine would)."""
    torch.manual_seed(6)
    logits = torch.randn(1, V)
    s = Sampler(0, torch.device("cpu"))
    g = torch.Generator().manual_seed(11)
    seq = [s(logits, [_row(temperature=1.0, generator=g, out=[0] * i)]).token_ids[0] for i in range(20)]
    fresh = torch.Generator().manual_seed(11)
    assert s(logits, [_row(temperature=1.0, generator=fresh, out=[0] * 13)]).token_ids[0] == seq[13]


def test_top_k_top_p_min_p_restrict_the_support():
    torch.manual_seed(3)
    logits = torch.randn(1, V) * 2
    s = Sampler(0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    top5 = set(logits[0].topk(5).indices.tolist())
    seen = {s(logits, [_row(temperature=1.0, top_k=5, generator=g, out=[0] * i)]).token_ids[0]
            for i in range(200)}
    assert seen <= top5 and len(seen) > 1
    probs = torch.softmax(logits[0], -1)
    sp, idx = probs.sort(descending=True)
    keep = int((sp.cumsum(0) < 0.5).sum()) + 1  # smallest prefix reaching 0.5
    allowed = set(idx[:keep].tolist())
    seen = {s(logits, [_row(temperature=1.0, top_p=0.5, generator=g, out=[0] * i)]).token_ids[0]
            for i in range(200)}
    assert seen <= allowed
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    seen = {s(logits, [_row(temperature=1.0, min_p=0.3, generator=g, out=[0] * i)]).token_ids[0]
            for i in range(200)}
    assert seen <= allowed


def test_penalties_as_defined():
    torch.manual_seed(4)
    base = torch.randn(V)
    out = [5, 5, 9]
    prompt = [1, 9, 20]
    x = base.clone()
    apply_penalties(x, _row(presence_penalty=0.5, frequency_penalty=0.25, prompt=prompt, out=out))
    exp = base.clone()
    exp[5] -= 0.5 + 2 * 0.25
    exp[9] -= 0.5 + 0.25
    assert torch.equal(x, exp)
    x = base.clone()
    apply_penalties(x, _row(repetition_penalty=1.3, prompt=prompt, out=out))
    exp = base.clone()
    for t in {1, 9, 20, 5}:
        exp[t] = base[t] / 1.3 if base[t] > 0 else base[t] * 1.3
    assert torch.equal(x, exp)


def test_penalty_changes_greedy_choice_and_ban_masks():
    logits = torch.zeros(1, V)
    logits[0, 7] = 1.0
    logits[0, 8] = 0.9
    s = Sampler(0, torch.device("cpu"))
    assert s(logits, [_row(temperature=0.0)]).token_ids == [7]
    assert s(logits, [_row(temperature=0.0, frequency_penalty=0.2, out=[7])]).token_ids == [8]
    assert s(logits, [_row(temperature=0.0, banned=(7,))]).token_ids == [8]


def test_logit_bias_adds_to_the_logits_it_names():
    torch.manual_seed(3)
    logits = torch.randn(2, V)
    before = logits.clone()
    s = Sampler(0, torch.device("cpu"))
    top = int(logits[0].argmax())
    forced = (top + 5) % V
    assert s(logits, [_row(temperature=0.0, logit_bias={forced: 100.0})] * 2).token_ids[0] == forced
    banned = s(logits[:1], [_row(temperature=0.0, logit_bias={top: -100.0})]).token_ids[0]
    assert banned == int(logits[0].clone().index_fill_(0, torch.tensor([top]), -1e9).argmax())
    # sampled rows draw from softmax(logits + bias): a +100 token takes all the mass
    g = torch.Generator().manual_seed(2)
    drawn = [s(logits[:1], [_row(temperature=1.0, logit_bias={forced: 100.0}, generator=g, out=[0] * i)]).token_ids[0]
             for i in range(20)]
    assert drawn == [forced] * 20
    assert torch.equal(logits, before)  # the caller's logits are not changed


def test_a_requests_logit_bias_goes_to_the_device_once():
    """The bias tensors are made once a request (kept in its sequence's cache), not every step: a
    whole vocabulary's bias rebuilt from its dict cost 5 ms a step, for every sequence of the batch."""
    torch.manual_seed(4)
    logits = torch.randn(1, V)
    s = Sampler(0, torch.device("cpu"))
    bias = {t: float(t % 7) - 3.0 for t in range(V)}  # every token biased
    cache: dict = {}
    row = SampleRow(SamplingParams(temperature=0.0, logit_bias=bias), [1, 2, 3], 3, None, device_tensors=cache)
    want = int((logits[0] + torch.tensor([bias[t] for t in range(V)])).argmax())
    assert s(logits, [row]).token_ids[0] == want
    made = cache[("logit_bias", torch.device("cpu"), torch.float32)]
    assert s(logits, [row]).token_ids[0] == want
    assert cache[("logit_bias", torch.device("cpu"), torch.float32)] is made and len(cache) == 1


def test_mixed_batch_rows_are_independent():
    torch.manual_seed(5)
    logits = torch.randn(3, V)
    s = Sampler(0, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    res = s(logits, [_row(temperature=0.0), _row(temperature=0.8, generator=g), _row(temperature=0.0, logprobs=0)])
    assert res.token_ids[0] == logits[0].argmax().item()
    assert res.token_ids[2] == logits[2].argmax().item()
    assert res.logprobs[0] is None and res.logprobs[2].top == []
    assert math.isclose(res.logprobs[2].logprob, torch.log_softmax(logits[2], -1).max().item(), abs_tol=1e-6)
