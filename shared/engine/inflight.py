"""A step in flight: launched, its tokens sampled on the device, not yet read back (async scheduling).

With async scheduling the engine launches step N + 1 before it reads step N's tokens, so the host's
work between steps (reading tokens back, stop checks, detokenizing, outputs, scheduling, filling the
next step's buffers) runs while the GPU computes instead of between its steps. Step N + 1's rows
whose input token step N sampled take it on the device (`TokenFeed`); the host learns it when it
retires step N (`InFlightStep.results`). A sequence that step N ends (a stop token or string) has
already been given a row in step N + 1: that row's token is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvmesh.engine.outputs import TokenLogprob
from kvmesh.engine.sampler import DeviceSample, SampleRow, host_logprobs
from kvmesh.engine.sequence import Sequence
from kvmesh.kv.host_copies import start_readback, to_device


@dataclass(frozen=True)
class TokenFeed:
    """Input tokens of a step that are still on the device: flat input row rows[i] takes tokens[i]."""

    rows: torch.Tensor
    """[k] int64: rows of the step's flat input ids (one a sequence whose input token is pending)."""
    tokens: torch.Tensor
    """[k] int64: those tokens, gathered from the previous step's samples (device order, no sync)."""

    def apply(self, input_ids: torch.Tensor) -> None:
        """Writes the tokens into a step's input ids [T] (after the host's placeholders were copied)."""
        input_ids.index_copy_(0, self.rows, self.tokens)


@dataclass
class InFlightStep:
    """A launched step's sampling rows and what they sampled, on its way to the host."""

    seqs: list[Sequence]
    """The sequences that sampled a token, in the order of the sample's rows."""
    rows: list[SampleRow]
    sample: DeviceSample
    _host: tuple[torch.Tensor, ...] = field(init=False)
    _done: Optional[torch.cuda.Event] = field(init=False)

    def __post_init__(self) -> None:
        self._host, self._done = start_readback(self.sample.tensors())
        self._row_of = {s.seq_id: i for i, s in enumerate(self.seqs)}

    def results(self) -> tuple[list[int], list[Optional[TokenLogprob]]]:
        """The sampled tokens and their logprobs (waits for the copy, and so for the step)."""
        if self._done is not None:
            self._done.synchronize()
        tokens = self._host[0].tolist()
        return tokens, host_logprobs(self.rows, tokens, self._host[1:])

    def token_of(self, seq: Sequence) -> torch.Tensor:
        """[1] int64 on the device: what this step sampled for seq (a view, nothing waited for)."""
        i = self._row_of[seq.seq_id]
        return self.sample.token_ids[i:i + 1]

    def feed(self, rows: list[int], seqs: list[Sequence], device: torch.device) -> Optional[TokenFeed]:
        """The next step's feed: flat input row rows[i] takes the token this step sampled for seqs[i]."""
        if not rows:
            return None
        idx = to_device(rows + [self._row_of[s.seq_id] for s in seqs], device)  # [2k]: rows, then sources
        k = len(rows)
        return TokenFeed(idx[:k], self.sample.token_ids.index_select(0, idx[k:]))
