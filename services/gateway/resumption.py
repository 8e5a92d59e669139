"""Resuming a choice on another decode worker after its worker died (or hung) mid-stream.

The gateway knows every token the client has been sent, so another decode worker can go on from
there: it prefills prompt + those tokens and generates the rest (`max_tokens` less what was sent).
For greedy decoding that is exactly the text the dead worker would have produced. It is done only
where the continuation cannot differ from an uninterrupted run in what the worker checks or
counts on the output alone:
- no stop strings (one could straddle the tokens sent and the new ones, which the new worker
  would not see as output);
- no presence or frequency penalty (they count output tokens, which the sent ones no longer are);
- the text sent equals the tokens sent detokenized (nothing held back, such as half a UTF-8
  character at the end, which the new worker would treat as prompt and never send).
Elsewhere the client gets the error, as before. A seeded sample resumes as a fresh draw from the
same seed: a valid sample, not the one an uninterrupted run would have drawn.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from kvmesh.wire import kvmesh_pb2 as pb


@dataclass
class Sent:
    """What a choice has sent the client so far."""

    ids: list[int] = field(default_factory=list)
    text: str = ""

    def add(self, token_ids: list[int], text: str) -> None:
        self.ids.extend(token_ids)
        self.text += text


def resumable(params: pb.SamplingParams, sent: Sent, detokenize: Optional[Callable[[list[int]], str]]) -> bool:
    """Whether a choice that has sent `sent` can go on on another worker."""
    return (detokenize is not None and bool(sent.ids) and len(sent.ids) < params.max_tokens
            and not params.stop and params.presence_penalty == 0 and params.frequency_penalty == 0
            and detokenize(list(sent.ids)) == sent.text)


def resumed_sampling(params: pb.SamplingParams, sent: int) -> pb.SamplingParams:
    """The sampling of the rest: `sent` tokens fewer to generate, no prompt logprobs (sent already)."""
    out = pb.SamplingParams()
    out.CopyFrom(params)
    out.max_tokens = params.max_tokens - sent
    out.min_tokens = max(0, params.min_tokens - sent)
    out.ClearField("prompt_logprobs")
    return out
