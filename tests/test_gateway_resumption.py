"""When a choice may go on on another decode worker, and with what sampling (resumption.py)."""
from __future__ import annotations

from kvmesh.gateway.resumption import Sent, resumable, resumed_sampling
from kvmesh.wire import kvmesh_pb2 as pb

DETOK = {(1, 2): "ab", (1, 2, 3): "ab\ufffd"}.get  # a stand-in for Tokenizer.decode: 3 is half a character


def detok(ids: list[int]) -> str:
    return DETOK(tuple(ids), "")


def test_only_where_the_rest_cannot_differ_from_an_uninterrupted_run():
    p = pb.SamplingParams(max_tokens=10, temperature=0)
    assert resumable(p, Sent([1, 2], "ab"), detok)
    assert not resumable(p, Sent([1, 2], "ab"), None)  # no tokenizer to check the text with
    assert not resumable(p, Sent([], ""), detok)  # nothing sent: routed again instead
    assert not resumable(p, Sent([1, 2, 3], "ab"), detok)  # half a character held back
    assert not resumable(pb.SamplingParams(max_tokens=2), Sent([1, 2], "ab"), detok)  # nothing left
    assert not resumable(pb.SamplingParams(max_tokens=10, stop=["x"]), Sent([1, 2], "ab"), detok)
    assert not resumable(pb.SamplingParams(max_tokens=10, presence_penalty=0.5), Sent([1, 2], "ab"), detok)
    assert not resumable(pb.SamplingParams(max_tokens=10, frequency_penalty=0.5), Sent([1, 2], "ab"), detok)
    assert resumable(pb.SamplingParams(max_tokens=10, repetition_penalty=1.2, seed=3), Sent([1, 2], "ab"), detok)


def test_the_rest_asks_for_what_is_left():
    p = pb.SamplingParams(max_tokens=10, min_tokens=4, temperature=0.7, seed=5, prompt_logprobs=2, logprobs=1)
    r = resumed_sampling(p, 3)
    assert (r.max_tokens, r.min_tokens, r.seed, r.logprobs, r.temperature) == (7, 1, 5, 1, p.temperature)
    assert not r.HasField("prompt_logprobs") and p.HasField("prompt_logprobs")
    assert resumed_sampling(p, 6).min_tokens == 0
