"""A decode step's inputs in fixed device buffers: what a CUDA graph of the step reads.

A graph replays the kernels it captured with the same pointers and grids, so every input of the
step lives in one buffer per batch size, refilled before each replay: token ids, positions, the
attention metadata and a write plan of fixed shape. Rows past the real batch are padding: no cached
prefix, their new row written to a scratch residual slot that no sequence owns, no page written.

The write plan has one entry per row (not one per completed block, as `metadata.build_write_plan`
makes it): row i completes its block when its new token is the block's last, and its new K/V row is
copied to its residual slot either way (where the block completed, that copy sits past the tail the
next step reads, so it is never used).

Block tables are staged as they grow. A sequence fed the same table (the same list object) as in
the last step keeps what was staged: its row is copied from its old row if it moved (a sequence
before it finished), and only the pages added since are converted. A new list is staged whole.
The engine's tables are append-only while a sequence runs (a preemption or an admission gives it a
new list). So a decode step converts one page a row every block_size steps, not every table every
step: `fill` at 61 rows took ~50 instead of ~150 us on the build machine.

A batch may carry a work list of fixed capacity for the decode kernels (`work_units`; filled only
for the graphs of ragged steps, `kernels/work_list.fill_fixed`): each sequence split in proportion
to its context, padding rows one unit each, spare units to the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvmesh.kernels.backend import AttentionMetadata, WritePlan
from kvmesh.kernels.metadata import SeqSlice
from kvmesh.kernels.work_list import WorkPlan, fill_fixed

if TYPE_CHECKING:
    from kvmesh.engine.inflight import TokenFeed


@dataclass(frozen=True)
class DecodeShape:
    """The fixed shape of one captured batch."""

    rows: int
    """Sequences (the graph's batch size; real ones first, then padding)."""
    table_width: int
    """Block-table columns: pages of the longest context a graph serves, plus the one being filled."""
    block_size: int
    num_slots: int
    """Residual slots in the cache (the write plan's rows of S start after them)."""
    scratch_slot: int
    """The residual slot the padding rows write into (owned by no sequence)."""
    work_units: int = 0
    """Capacity of the decode kernels' work list (0: none)."""


class DecodeBatch:
    """Host staging buffers and their device twins for one `DecodeShape`; `fill` then `metadata`."""

    def __init__(self, shape: DecodeShape, device: torch.device) -> None:
        self.shape = shape
        n, w, bs, u = shape.rows, shape.table_width, shape.block_size, shape.work_units
        # int64: ids | positions | block ids | residual src | residual dst | block rows [n, bs]
        self._host64 = torch.zeros(5 * n + n * bs, dtype=torch.int64)
        # int32: prefix lens | residual slots | seq units [n] | work [u] | block tables [n, w]
        self._head32 = 3 * n + u  # the part before the tables
        self._host32 = torch.zeros(self._head32 + n * w, dtype=torch.int32)
        if device.type == "cuda":  # one copy each a step, not waiting on a pageable staging copy
            self._host64, self._host32 = self._host64.pin_memory(), self._host32.pin_memory()
        self._dev64 = torch.zeros_like(self._host64, device=device)
        self._dev32 = torch.zeros_like(self._host32, device=device)
        self.input_ids, self.positions = self._dev64[:n], self._dev64[n:2 * n]  # [n] each
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1]: one row each
        # the last copy out of the pinned buffers: the next fill waits for it before writing them
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        # residual slot -> (its block table staged last step, held so its identity stays its own;
        # pages staged; row)
        self._staged: dict[int, tuple[list[int], int, int]] = {}
        self.fill([], [])

    def fill(self, tokens: list[int], seqs: list[SeqSlice], work_splits: int = 0,
             feed: TokenFeed | None = None) -> None:
        """Stages one decode step (tokens[i]: sequence i's new token) and copies it to the device
        buffers, in stream order: the kernels queued before it have read the previous step's. A
        block table passed again as the same list must only have grown (module docstring).
        `work_splits` > 0: the work list too, at that many splits of the longest context (the caller
        chose them to fit, `work_list.fixed_splits`). `feed`: tokens still on the device, written
        over their rows' placeholders after the copy."""
        n, w, bs, u = self.shape.rows, self.shape.table_width, self.shape.block_size, self.shape.work_units
        b = len(seqs)
        if b > n:
            raise ValueError(f"{b} sequences do not fit a decode batch of {n}")
        if self._copied is not None:
            self._copied.synchronize()
        h64, h32 = self._host64.numpy(), self._host32.numpy()
        ids, pos, block_ids, res_src, res_dst = (h64[i * n:(i + 1) * n] for i in range(5))
        block_rows = h64[5 * n:].reshape(n, bs)
        prefix, slots, seq_units, work = h32[:n], h32[n:2 * n], h32[2 * n:3 * n], h32[3 * n:self._head32]
        tables = h32[self._head32:].reshape(n, w)
        new_base = self.shape.num_slots * bs  # the step's new rows follow the residual rows in S
        p = np.array([s.prefix_len for s in seqs] + [0] * (n - b), dtype=np.int64)  # [n]
        r = np.array([s.residual_slot for s in seqs] + [self.shape.scratch_slot] * (n - b), dtype=np.int64)
        ids[:] = 0
        ids[:b] = tokens
        pos[:] = p
        prefix[:] = p
        slots[:] = r
        res_src[:] = new_base + np.arange(n)
        res_dst[:] = r * bs + p % bs
        block_ids[:] = -1
        completes = (p + 1) % bs == 0
        completes[b:] = False
        block_rows[:] = (r * bs)[:, None] + np.arange(bs)[None, :]  # the block's residual rows...
        block_rows[:, -1] = res_src  # ...and the new one last
        staged, dst, src, plan = {}, [], [], []  # plan[i]: (table, pages staged already, pages to stage)
        for i, s in enumerate(seqs):
            pages, end_i = s.block_table, min(len(s.block_table), w)
            held, done, row = self._staged.get(s.residual_slot, (None, 0, i))
            if held is not pages or done > end_i:  # a new table: stage it whole
                done = 0
            elif row != i:  # it moved (a sequence before it finished): its staged pages come along
                dst.append(i)
                src.append(row)
            plan.append((pages, done, end_i))
            staged[s.residual_slot] = (pages, end_i, i)
        if dst:
            tables[dst] = tables[src]  # the right side is a copy: moves may overlap
        for i, (pages, done, end_i) in enumerate(plan):
            if end_i > done:
                tables[i, done:end_i] = pages[done:end_i]
            if completes[i]:
                block_ids[i] = pages[p[i] // bs]
        self._staged = staged
        if work_splits:
            fill_fixed(p + 1, work_splits, work, seq_units)
        rows = max(b, 1)  # table rows past the batch are never read (their prefix is 0)
        end = self._head32 + rows * w
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32[:end].copy_(self._host32[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if feed is not None:
            feed.apply(self.input_ids)

    def metadata(self, max_prefix_len: int, work: bool = False) -> AttentionMetadata:
        """The step's metadata over the device buffers; `max_prefix_len` is what the kernels' split
        choice sees (a graph's: the longest prefix it serves, at least the batch's real one); `work`:
        the decode kernels run over the work list."""
        n, w, bs = self.shape.rows, self.shape.table_width, self.shape.block_size
        d64, d32 = self._dev64, self._dev32
        write = WritePlan(block_rows=d64[5 * n:].view(n, bs), block_ids=d64[2 * n:3 * n],
                          residual_src=d64[3 * n:4 * n], residual_dst=d64[4 * n:5 * n], paired=True)
        if work and not self.shape.work_units:
            raise ValueError("this decode batch has no work list")
        plan = WorkPlan(0, d32[3 * n:self._head32], d32[2 * n:3 * n]) if work else None
        return AttentionMetadata(query_start_loc=self.query_start, prefix_lens=d32[:n],
                                 block_tables=d32[self._head32:].view(n, w), residual_slots=d32[n:2 * n],
                                 max_query_len=1, max_prefix_len=max_prefix_len, write=write, work=plan)
