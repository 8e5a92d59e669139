"""A ragged decode batch's work list: each sequence split in proportion to its context, so every
program reads about as many tokens as one split of the longest (FlashInfer plans its decode work
the same way, on the host, from the lengths it already has).

With one split count for the whole batch, a long sequence among short ones either gets few splits
(its programs stream alone long after the rest are done) or many (every short sequence gets as
many near-empty programs, each paying its fixed cost). Here a batch whose longest sequence takes S
splits gives sequence b n_b = ceil(S * context_b / longest) of them, and the kernels run one
program per (unit, KV head) from a flat list of units, (sequence, split, n_b) packed in an int32:

    work       int32 [U]  b << 16 | split << 8 | n_b      units sequence by sequence
    seq_units  int32 [B]  first_unit << 8 | n_b           for the reduction of b's partials

Partials are rows of [U, H] (unit u's split of its sequence, query head h), not [B, H, splits]:
their count is the work's, not B x the longest's splits.

A CUDA graph's launches keep their grids, so a graph's work list has a fixed capacity (`fill_fixed`):
the step's units first, then spare units (SPARE_UNIT) that read nothing and write only their own
partial rows, which no sequence's reduction reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

MAX_WORK_SPLITS = 128  # splits of the longest sequence (n_b < 256 fits the packing)
MAX_WORK_SEQS = 1 << 15  # b << 16 stays a positive int32
# sequence 0, split 255 of 255: its share of the pages starts past them all (255 ceil(n / 255) >= n)
# and it is not the last split, so it takes no tail: it loads its q and writes its partial row, nothing else
SPARE_UNIT = 255 << 8 | 255


@dataclass(frozen=True)
class WorkPlan:
    """One split count's work list on one device."""

    splits: int
    """Splits of the longest sequence (the stride the kernels are launched with; 0 in a CUDA
    graph's fixed list, whose counts change between replays)."""
    work: torch.Tensor
    """int32 [U]: b << 16 | split << 8 | n_b."""
    seq_units: torch.Tensor
    """int32 [B]: the sequence's first unit << 8 | n_b."""

    @property
    def units(self) -> int:
        return int(self.work.shape[0])


@dataclass
class BatchContexts:
    """A decode step's contexts (cached prefix + the new token) on the host, and the work lists
    planned from them (built once per step and split count, reused by every layer)."""

    lens: torch.Tensor
    """int64 [B] on the CPU."""
    longest: int = field(init=False)
    batch: int = field(init=False)
    _units: list[int] | None = field(default=None, repr=False)
    _plans: dict = field(default_factory=dict, repr=False)
    choices: dict = field(default_factory=dict, repr=False)
    """Split counts chosen for this step, by launch shape (`splits.num_splits`): every layer asks."""

    def __post_init__(self) -> None:
        self.longest, self.batch = int(self.lens.max()), int(self.lens.shape[0])

    @classmethod
    def of(cls, contexts: list[int]) -> "BatchContexts | None":
        """The contexts of a ragged batch; None where every sequence is as long as the longest (one
        split count serves them all) or the batch is too large to pack."""
        if not contexts or len(contexts) >= MAX_WORK_SEQS or min(contexts) == max(contexts):
            return None
        return cls(torch.tensor(contexts, dtype=torch.int64))

    def splits_of(self, splits: int | torch.Tensor) -> torch.Tensor:
        """int64 [B]: each sequence's splits where the longest takes `splits` ([S, 1] counts: [S, B])."""
        return _seq_splits(self.lens, self.longest, splits)

    def units(self, splits: int) -> int:
        """Units (programs per KV head) of the work list at `splits` for the longest sequence."""
        if self._units is None:  # every count at once: the split choice asks for each of them
            counts = torch.arange(1, MAX_WORK_SPLITS + 1, dtype=torch.int64)[:, None]
            self._units = self.splits_of(counts).sum(1).tolist()
        return self._units[min(splits, MAX_WORK_SPLITS) - 1]

    def plan(self, splits: int, device: torch.device) -> WorkPlan:
        key = (splits, device)
        if key not in self._plans:
            work, seq_units = _pack(self.splits_of(splits).numpy())
            self._plans[key] = WorkPlan(splits, _to(torch.from_numpy(work), device),
                                        _to(torch.from_numpy(seq_units), device))
        return self._plans[key]

    def pays(self, splits: int) -> bool:
        """Whether the work list has fewer units than every sequence at `splits` would."""
        return splits > 1 and self.units(splits) < self.batch * splits


def fixed_splits(contexts: np.ndarray, capacity: int, min_tokens: int) -> int:
    """Splits of the longest of `contexts` (int64 [B]) for a work list of at most `capacity` units:
    the most that fit, each split of the longest at least `min_tokens` tokens (1 where none fit)."""
    longest = int(contexts.max())
    lo, hi = 1, max(1, min(MAX_WORK_SPLITS, longest // max(1, min_tokens)))
    while lo < hi:  # the largest s in [lo, hi] whose units fit (units grow with s; lo fits, or is 1)
        mid = (lo + hi + 1) // 2
        if int(_seq_splits(contexts, longest, mid).sum()) <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fill_fixed(contexts: np.ndarray, splits: int, work: np.ndarray, seq_units: np.ndarray) -> int:
    """Writes the work list of `contexts` (int64 [B]) at `splits` for the longest into the fixed
    buffers work int32 [capacity] (then SPARE_UNIT to the end) and seq_units int32 [B]; returns the
    units used. The caller chose `splits` so that they fit (`fixed_splits`)."""
    units, firsts = _pack(_seq_splits(contexts, int(contexts.max()), splits))
    used = units.shape[0]
    if used > work.shape[0]:
        raise ValueError(f"{used} units do not fit a work list of {work.shape[0]}")
    work[:used] = units
    work[used:] = SPARE_UNIT
    seq_units[:] = firsts
    return used


def _seq_splits(lens, longest: int, splits):
    """Each sequence's splits where the longest (`longest` tokens) takes `splits`: ceil(splits x
    context / longest), at least 1 (torch or numpy, broadcasting)."""
    return ((lens * splits + longest - 1) // longest).clip(min=1)


def _pack(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(work int64 [U], seq_units int64 [B]) for n [B] splits a sequence, units sequence by sequence."""
    ends = np.cumsum(n)
    first = ends - n
    seq = np.repeat(np.arange(n.shape[0], dtype=np.int64), n)  # [U] each unit's sequence
    split = np.arange(int(ends[-1]), dtype=np.int64) - first[seq]
    return (seq << 16) | (split << 8) | n[seq], (first << 8) | n


def _to(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """int32 on `device`; to a GPU through pinned memory, so the copy does not wait for the kernels
    already queued (the plan is made at the step's first attention launch, layers into the step)."""
    x = x.to(torch.int32)
    if torch.device(device).type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
