"""A step in flight: launched, its tokens sampled on the device, not yet read back (async scheduling).

With async scheduling the engine launches step N + 1 before it reads step N's tokens, so the host's
work between steps (reading tokens back, stop checks, detokenizing, outputs, scheduling, filling the
next step's buffers) runs while the GPU computes instead of between its steps. Step N + 1's rows
whose input token step N sampled take it on the device (`TokenFeed`); the host learns it when it
retires step N (`InFlightStep.token_ids`). A sequence that step N ends (a stop token or string) has
already been given a row in step N + 1: that row's token is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvmesh.engine.sequence import Sequence


def device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] on `device`, without waiting for the device: a copy from pageable memory
    would (PyTorch syncs the stream after a blocking host-to-device copy), and so would wait for the
    step in flight. Pinned memory is not reused before its copy is done (PyTorch's host allocator)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


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


class TokenReadback:
    """Copies a step's sampled tokens to the host without waiting: two pinned buffers, used in turn
    (a step's copy may still be running while the next step's starts). On the CPU, no copy."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._buffers = [torch.empty(max_rows, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
            if self._cuda else []
        self._turn = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """(host tensor [N] that will hold tokens [N], the event that says it does)."""
        if not self._cuda:
            return tokens, None
        if tokens.shape[0] > self._buffers[0].shape[0]:  # n > 1 forks never reach here; safety only
            self._buffers = [torch.empty(tokens.shape[0], dtype=torch.int64, pin_memory=True) for _ in range(2)]
        host = self._buffers[self._turn][:tokens.shape[0]]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done


@dataclass
class InFlightStep:
    """A launched step's sampled sequences and their tokens, on their way to the host."""

    seqs: list[Sequence]
    """The sequences that sampled a token, in the order of `tokens`."""
    tokens: torch.Tensor
    """[N] int64 on the device."""
    host: torch.Tensor
    """[N] int64 on the host, valid once `done` has happened."""
    done: Optional[torch.cuda.Event]

    def __post_init__(self) -> None:
        self._row_of = {s.seq_id: i for i, s in enumerate(self.seqs)}

    def token_ids(self) -> list[int]:
        """The sampled tokens (waits for the copy, and so for the step)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()

    def feed(self, rows: list[int], seqs: list[Sequence], device: torch.device) -> Optional[TokenFeed]:
        """The next step's feed: flat input row rows[i] takes the token this step sampled for seqs[i]."""
        if not rows:
            return None
        idx = device_ints(rows + [self._row_of[s.seq_id] for s in seqs], device)  # [2k]: rows, then sources
        k = len(rows)
        return TokenFeed(idx[:k], self.tokens.index_select(0, idx[k:]))
