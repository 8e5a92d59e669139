"""CUDA graphs around the decode step.

Launched kernel by kernel, a decode step costs the host about a millisecond a layer (some 35 launches,
each with its Python around it) while the GPU works a tenth of that: small batches are bound by the
launches, not by memory. A graph replays the whole step's kernels in one launch.

One graph per (batch size, context bucket): every batch size at the smallest bucket when the engine
starts (`warm_up`), the longer buckets the first time a step needs them:
- the batch is padded up to the next of 1, 2, 4, 8, 16, 24, ... (`batch_sizes`); its inputs live in
  fixed buffers (`decode_batch.py`), refilled before each replay;
- the decode kernels choose their split counts on the host from the longest context; a graph
  captures the choice for the top of its bucket (powers of two from 512 up to
  `--max-seq-len-to-capture`), and every sequence's own length still comes from the device buffers,
  so a shorter batch runs correctly with the bucket's splits;
- graphs share one memory pool (their replays never overlap; each leaves its logits in one
  shared buffer, copied out before the next replay).
- a ragged step (contexts that differ, so that one split count for all would leave the longest
  sequence's programs streaming alone) replays a second graph of its (batch size, bucket), whose
  decode kernels run over a work list of fixed capacity (`kernels/work_list.py`, `fill_fixed`):
  each sequence split in proportion to its context, filled on the host before each replay, spare
  units to the end. It is captured the first time a step needs it; a step takes it where its work
  list gives the longest sequence RAGGED_GAIN times the bucket's uniform splits or more
  (`ragged_splits`).
Steps the graphs do not serve run eagerly: prompt chunks and mixed steps, contexts past the limit,
batches larger than `--max-num-seqs`, `--enforce-eager`.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from kvmesh.engine.decode_batch import DecodeBatch, DecodeShape
from kvmesh.engine.inflight import TokenFeed
from kvmesh.kernels.metadata import SeqSlice
from kvmesh.kernels.splits import MIN_TOKENS_PER_SPLIT, num_sms, num_splits
from kvmesh.kernels.work_list import fixed_splits
from kvmesh.kv.pool import KVCache

log = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 512  # below this the split choice barely moves; fewer graphs
# a ragged graph's work list holds the batch's rows plus a wave of units at this many programs an SM
# (the decode kernels keep 4-16 resident): room to split the long sequences of a step
WORK_RESIDENT = 8
# a step takes the ragged graph where its work list splits the longest sequence this many times as
# often as the uniform graph would, or more (H200, benchmarks/ragged_step.py: at 2x, even spreads of
# contexts, 0.97-1.07x the uniform graph's time: its second launch and partials cost about what the
# splits save; at 2.9-8x, one or four 8K sequences among 512-1K ones, 1.09-1.42x faster)
RAGGED_GAIN = 2.5


def batch_sizes(max_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes: 1, 2, 4, then multiples of 8, the last `max_seqs` (a step of b
    sequences replays the smallest size >= b)."""
    return tuple(sorted({b for b in (1, 2, 4) if b < max_seqs} | set(range(8, max_seqs, 8)) | {max_seqs}))


def context_bucket(context: int, max_context: int) -> int:
    """The longest context (cached prefix + the new token) a graph serving `context` is captured
    for: the next power of two, at least MIN_CONTEXT_BUCKET, at most `max_context`."""
    return min(max(MIN_CONTEXT_BUCKET, 1 << (context - 1).bit_length()), max_context)


class DecodeGraphs:
    """Captures and replays decode steps of `model` over `cache` (`takes`, then `run`). With
    `capture` False (the CPU) the same buffers run eagerly: every step of this path but the graph."""

    def __init__(self, model, cache: KVCache, backend, *, max_seqs: int, max_context: int, scratch_slot: int,
                 capture: bool = True) -> None:
        self.model, self.cache, self.backend = model, cache, backend
        self.sizes = batch_sizes(max_seqs)
        self.max_context = max_context
        self.capture = capture
        self._scratch_slot = scratch_slot
        self._batches: dict[int, DecodeBatch] = {}
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._uniform_splits: dict[tuple[int, int], int] = {}  # (batch size, bucket): `ragged_splits`' reference
        self._logits: torch.Tensor | None = None  # [max size, vocab]: the graphs' output rows
        self._pool = None
        self.failed: str | None = None
        """Why a capture failed (every decode step then runs eagerly), or None."""
        self.replays = 0

    @property
    def captured(self) -> list[tuple[int, int, bool]]:
        """(batch size, context bucket, ragged) of every graph held."""
        return sorted(self._graphs)

    def warm_up(self) -> None:
        """Captures every batch size at the smallest context bucket now (a serving engine at start),
        so short steps never stall on a capture; longer buckets are captured as steps meet them."""
        if not self.capture:
            return
        ctx = context_bucket(1, self.max_context)
        for n in self.sizes:
            if self.failed is None and (n, ctx, False) not in self._graphs:
                self._capture(self._batch(n), n, ctx, 0)

    def takes(self, seqs: list[SeqSlice], sample_rows: list[int], prompt_rows: list) -> bool:
        """Whether the step is a decode step a graph serves: every sequence one new token, sampled,
        no prompt logprobs, the longest context within the limit."""
        return (self.failed is None and 0 < len(seqs) <= self.sizes[-1] and not prompt_rows
                and all(s.num_new == 1 for s in seqs) and sample_rows == list(range(len(seqs)))
                and max(s.prefix_len for s in seqs) + 1 <= self.max_context)

    def run(self, tokens: list[int], seqs: list[SeqSlice], feed: TokenFeed | None = None) -> torch.Tensor | None:
        """Logits [B, vocab] (model dtype) of the step, or None where the capture failed (run it eagerly).
        `feed`: tokens still on the device, written over their rows' placeholders."""
        b = len(seqs)
        n = next(size for size in self.sizes if size >= b)
        ctx = context_bucket(max(s.prefix_len for s in seqs) + 1, self.max_context)
        batch = self._batch(n)
        work = self.ragged_splits(seqs, n, ctx)
        if not self.capture:
            batch.fill(tokens, seqs, work, feed)
            return self._forward(batch, ctx, work > 0)[:b]
        key = (n, ctx, work > 0)
        if key not in self._graphs and not self._capture(batch, n, ctx, work):
            return None
        batch.fill(tokens, seqs, work, feed)
        self._graphs[key].replay()
        self.replays += 1
        return self._logits[:b].clone()  # the next replay of any graph overwrites the buffer

    def ragged_splits(self, seqs: list[SeqSlice], n: int, ctx: int) -> int:
        """Splits of the longest sequence in the work list of a ragged graph, where that gives it
        RAGGED_GAIN times the bucket's uniform choice or more (`splits.num_splits` at the top of the
        bucket, WORK_RESIDENT programs an SM); else 0 (the uniform graph)."""
        contexts = [s.prefix_len + 1 for s in seqs]
        if min(contexts) == max(contexts):
            return 0
        padded = np.array(contexts + [1] * (n - len(seqs)), dtype=np.int64)  # padding rows: the new token
        s = fixed_splits(padded, self._work_units(n), MIN_TOKENS_PER_SPLIT)
        if (n, ctx) not in self._uniform_splits:
            self._uniform_splits[(n, ctx)] = num_splits(n, self.cache.layout.kv_heads, ctx,
                                                        num_sms(self.cache.device), WORK_RESIDENT)
        return s if s >= RAGGED_GAIN * self._uniform_splits[(n, ctx)] else 0

    def _work_units(self, n: int) -> int:
        return n + -(-num_sms(self.cache.device) * WORK_RESIDENT // self.cache.layout.kv_heads)

    def _batch(self, n: int) -> DecodeBatch:
        if n not in self._batches:
            L = self.cache.layout
            width = -(-self.max_context // L.block_size) + 1
            shape = DecodeShape(rows=n, table_width=width, block_size=L.block_size,
                                num_slots=self.cache.num_residual_slots, scratch_slot=self._scratch_slot,
                                work_units=self._work_units(n) if n > 1 else 0)
            self._batches[n] = DecodeBatch(shape, self.cache.device)
        return self._batches[n]

    def _forward(self, batch: DecodeBatch, ctx: int, work: bool) -> torch.Tensor:
        """Logits [n, vocab] of the batch's buffers; the kernels split for contexts up to `ctx`, or
        run over the batch's work list (`work`)."""
        meta = batch.metadata(max_prefix_len=ctx - 1, work=work)
        hidden = self.model(batch.input_ids, batch.positions, meta, self.cache, self.backend)  # [n, hidden]
        return self.model.compute_logits(hidden, upcast=False)

    def _capture(self, batch: DecodeBatch, n: int, ctx: int, work: int) -> bool:
        """Captures the graph of (n, ctx, work > 0); `work`: a ragged step's splits for its work list."""
        batch.fill([], [], work and 1)  # padding only: warm-up and capture touch nothing but the scratch slot
        try:
            side = torch.cuda.Stream(self.cache.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles the kernels, fills the launchers' caches
                for _ in range(2):
                    logits = self._forward(batch, ctx, work > 0)
            torch.cuda.current_stream().wait_stream(side)
            if self._logits is None:
                self._logits = torch.empty(self.sizes[-1], logits.shape[1], dtype=logits.dtype,
                                           device=logits.device)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._logits[:n].copy_(self._forward(batch, ctx, work > 0))
        except Exception as e:  # a kernel that syncs or allocates on the host: eager from here on
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("capturing a decode step (batch %d, context %d) failed; decode steps run eagerly: %s",
                        n, ctx, self.failed)
            return False
        self._graphs[(n, ctx, work > 0)] = graph
        log.info("captured a decode step: batch %d, contexts up to %d%s", n, ctx, ", ragged" if work else "")
        return True
