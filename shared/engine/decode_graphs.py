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
Steps the graphs do not serve run eagerly: prompt chunks and mixed steps, contexts past the limit,
batches larger than `--max-num-seqs`, `--enforce-eager`. A ragged batch inside a graph takes one
split count for every sequence (the eager path's work list, `kernels/work_list.py`, needs a grid
sized by its units).
"""
from __future__ import annotations

import logging

import torch

from kvmesh.engine.decode_batch import DecodeBatch, DecodeShape
from kvmesh.kernels.metadata import SeqSlice
from kvmesh.kv.pool import KVCache

log = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 512  # below this the split choice barely moves; fewer graphs


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
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [max size, vocab]: the graphs' output rows
        self._pool = None
        self.failed: str | None = None
        """Why a capture failed (every decode step then runs eagerly), or None."""
        self.replays = 0

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(batch size, context bucket) of every graph held."""
        return sorted(self._graphs)

    def warm_up(self) -> None:
        """Captures every batch size at the smallest context bucket now (a serving engine at start),
        so short steps never stall on a capture; longer buckets are captured as steps meet them."""
        if not self.capture:
            return
        ctx = context_bucket(1, self.max_context)
        for n in self.sizes:
            if self.failed is None and (n, ctx) not in self._graphs:
                self._capture(self._batch(n), n, ctx)

    def takes(self, seqs: list[SeqSlice], sample_rows: list[int], prompt_rows: list) -> bool:
        """Whether the step is a decode step a graph serves: every sequence one new token, sampled,
        no prompt logprobs, the longest context within the limit."""
        return (self.failed is None and 0 < len(seqs) <= self.sizes[-1] and not prompt_rows
                and all(s.num_new == 1 for s in seqs) and sample_rows == list(range(len(seqs)))
                and max(s.prefix_len for s in seqs) + 1 <= self.max_context)

    def run(self, tokens: list[int], seqs: list[SeqSlice]) -> torch.Tensor | None:
        """Logits [B, vocab] (model dtype) of the step, or None where the capture failed (run it eagerly)."""
        b = len(seqs)
        n = next(size for size in self.sizes if size >= b)
        ctx = context_bucket(max(s.prefix_len for s in seqs) + 1, self.max_context)
        batch = self._batch(n)
        if not self.capture:
            batch.fill(tokens, seqs)
            return self._forward(batch, ctx)[:b]
        if (n, ctx) not in self._graphs and not self._capture(batch, n, ctx):
            return None
        batch.fill(tokens, seqs)
        self._graphs[(n, ctx)].replay()
        self.replays += 1
        return self._logits[:b].clone()  # the next replay of any graph overwrites the buffer

    def _batch(self, n: int) -> DecodeBatch:
        if n not in self._batches:
            L = self.cache.layout
            width = -(-self.max_context // L.block_size) + 1
            shape = DecodeShape(rows=n, table_width=width, block_size=L.block_size,
                                num_slots=self.cache.num_residual_slots, scratch_slot=self._scratch_slot)
            self._batches[n] = DecodeBatch(shape, self.cache.device)
        return self._batches[n]

    def _forward(self, batch: DecodeBatch, ctx: int) -> torch.Tensor:
        """Logits [n, vocab] of the batch's buffers; the kernels split for contexts up to `ctx`."""
        meta = batch.metadata(max_prefix_len=ctx - 1)
        hidden = self.model(batch.input_ids, batch.positions, meta, self.cache, self.backend)  # [n, hidden]
        return self.model.compute_logits(hidden, upcast=False)

    def _capture(self, batch: DecodeBatch, n: int, ctx: int) -> bool:
        batch.fill([], [])  # padding only: warm-up and capture touch nothing but the scratch slot
        try:
            side = torch.cuda.Stream(self.cache.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles the kernels, fills the launchers' caches
                for _ in range(2):
                    logits = self._forward(batch, ctx)
            torch.cuda.current_stream().wait_stream(side)
            if self._logits is None:
                self._logits = torch.empty(self.sizes[-1], logits.shape[1], dtype=logits.dtype,
                                           device=logits.device)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._logits[:n].copy_(self._forward(batch, ctx))
        except Exception as e:  # a kernel that syncs or allocates on the host: eager from here on
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("capturing a decode step (batch %d, context %d) failed; decode steps run eagerly: %s",
                        n, ctx, self.failed)
            return False
        self._graphs[(n, ctx)] = graph
        log.info("captured a decode step: batch %d, contexts up to %d", n, ctx)
        return True
