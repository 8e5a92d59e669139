"""CUDA graphs around the steps with prompt chunks (the steps `decode_graphs.py` does not take).

Launched kernel by kernel, such a step is bound by the host: SmolLM2 at 8,192 new tokens a step
(int4 pages, H200, `benchmarks/step_profile.py`) keeps the GPU busy 9-13 ms of a 39-43 ms step,
the rest is ~225 Triton launches and ~300 torch ops, each with its Python around it. A graph
replays the step's kernels in one launch.

One graph per token bucket (`token_buckets`: 256, 512, 1,024, 2,048, then every 2,048 up to
--max-num-batched-tokens), all captured when the engine starts (`warm_up`). A step pads up to its bucket
and to `max_seqs` sequences (`chunk_batch.py`): the padding rows cost the GPU their share of the
dense layers, and the prefill kernel runs over a tile list of the real tiles only. Decode rows of a
mixed step run in the prefill kernel (a tile each, pages read in place), which a graph can size;
no prefix page is staged. Graphs share one memory pool (their replays never overlap) and one
logits buffer, copied out before the next replay.
Steps the graphs do not take run eagerly: prompt logprobs, more tokens than the largest bucket,
more sequences than `max_seqs`, contexts past `max_context`, --enforce-eager.
"""
from __future__ import annotations

import logging

import torch

from kvmesh.engine.chunk_batch import ChunkBatch, ChunkShape
from kvmesh.engine.inflight import TokenFeed
from kvmesh.kernels.metadata import SeqSlice
from kvmesh.kernels.paged_attention import tile_tokens
from kvmesh.kv.pool import KVCache

log = logging.getLogger(__name__)

SMALL_BUCKETS = (256, 512, 1024, 2048)
BUCKET_STEP = 2048  # past the small buckets: padding costs at most this many rows of dense work


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The captured token counts: the small buckets under `max_tokens`, then every BUCKET_STEP, the
    last `max_tokens` (a step of t new tokens replays the smallest bucket >= t)."""
    return tuple(sorted({b for b in SMALL_BUCKETS if b < max_tokens}
                        | set(range(2 * BUCKET_STEP, max_tokens, BUCKET_STEP)) | {max_tokens}))


class ChunkGraphs:
    """Captures and replays steps with prompt chunks of `model` over `cache` (`takes`, then `run`).
    With `capture` False (the CPU) the same buffers run eagerly: every step of this path but the graph."""

    def __init__(self, model, cache: KVCache, backend, *, max_seqs: int, max_tokens: int, max_context: int,
                 scratch_slot: int, capture: bool = True) -> None:
        self.model, self.cache, self.backend = model, cache, backend
        self.buckets = token_buckets(max_tokens)
        self.max_seqs, self.max_context = max_seqs, max_context
        self.capture = capture
        L = cache.layout
        self._shape = dict(rows=max_seqs, table_width=-(-max_context // L.block_size), block_size=L.block_size,
                           num_slots=cache.num_residual_slots, scratch_slot=scratch_slot,
                           tile_tokens=tile_tokens(model.config.num_heads // L.kv_heads))
        self._batches: dict[int, ChunkBatch] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [max_seqs, vocab]: the graphs' output rows
        self._pool = None
        self.failed: str | None = None
        """Why a capture failed (every such step then runs eagerly), or None."""
        self.replays = 0

    @property
    def captured(self) -> list[int]:
        """The token buckets of the graphs held."""
        return sorted(self._graphs)

    def warm_up(self) -> None:
        """Captures every bucket now (a serving engine at start), so no prompt step stalls on a capture."""
        if not self.capture:
            return
        for bucket in self.buckets:
            if self.failed is None and bucket not in self._graphs:
                self._capture(self._batch(bucket), bucket)

    def takes(self, seqs: list[SeqSlice], sample_rows: list[int], prompt_rows: list) -> bool:
        """Whether a graph serves the step: a prompt chunk in it, no prompt logprobs, within the
        largest bucket, `max_seqs` and `max_context`."""
        return (self.failed is None and 0 < len(seqs) <= self.max_seqs and not prompt_rows
                and any(s.num_new > 1 for s in seqs) and sum(s.num_new for s in seqs) <= self.buckets[-1]
                and max(s.prefix_len + s.num_new for s in seqs) <= self.max_context)

    def run(self, chunks: list[list[int]], seqs: list[SeqSlice], sample_rows: list[int],
            feed: TokenFeed | None = None) -> torch.Tensor | None:
        """Logits [len(sample_rows), vocab] (model dtype) of the step, an empty [0, vocab] tensor where
        no row samples, or None where the capture failed (run it eagerly). `feed`: tokens still on
        the device, written over their rows' placeholders."""
        t = sum(s.num_new for s in seqs)
        bucket = next(b for b in self.buckets if b >= t)
        batch = self._batch(bucket)
        n = len(sample_rows)
        if not self.capture:
            batch.fill(chunks, seqs, sample_rows, feed)
            return self._forward(batch)[:n]
        if bucket not in self._graphs and not self._capture(batch, bucket):
            return None
        batch.fill(chunks, seqs, sample_rows, feed)
        self._graphs[bucket].replay()
        self.replays += 1
        return self._logits[:n].clone()  # the next replay of any graph overwrites the buffer

    def _batch(self, bucket: int) -> ChunkBatch:
        if bucket not in self._batches:
            self._batches[bucket] = ChunkBatch(ChunkShape(tokens=bucket, **self._shape), self.cache.device)
        return self._batches[bucket]

    def _forward(self, batch: ChunkBatch) -> torch.Tensor:
        """Logits [max_seqs, vocab] of the batch's buffers (rows past the step's sample rows: row 0's)."""
        hidden = self.model(batch.input_ids, batch.positions, batch.metadata(), self.cache, self.backend)
        return self.model.compute_logits(hidden[batch.logit_rows], upcast=False)  # [max_seqs, vocab]

    def _capture(self, batch: ChunkBatch, bucket: int) -> bool:
        batch.fill([], [], [])  # padding only: warm-up and capture write no page and no slot
        try:
            side = torch.cuda.Stream(self.cache.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles the kernels, fills the launchers' caches
                for _ in range(2):
                    logits = self._forward(batch)
            torch.cuda.current_stream().wait_stream(side)
            if self._logits is None:
                self._logits = torch.empty_like(logits)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._logits.copy_(self._forward(batch))
        except Exception as e:  # a kernel that syncs or allocates on the host: eager from here on
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("capturing a prompt step (%d tokens) failed; prompt steps run eagerly: %s", bucket,
                        self.failed)
            return False
        self._graphs[bucket] = graph
        log.info("captured a prompt step: %d tokens, up to %d sequences", bucket, self.max_seqs)
        return True
