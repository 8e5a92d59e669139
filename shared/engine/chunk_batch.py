"""A prompt step's inputs in fixed device buffers: what a CUDA graph of a step with prompt chunks
reads (`chunk_graphs.py`), the way `decode_batch.py` holds a decode step's.

A graph replays its kernels with the same pointers and grids, so the step is padded to its bucket:
`tokens` rows (the padding rows compute garbage that nothing reads) and `rows` sequences (the
padding sequences own no new token, no page, and the scratch residual slot, which nothing touches).
Every varying size becomes a capacity:
- the prefill kernel's tiles: a tile list (`AttentionMetadata.tiles`), the heaviest tiles first
  (`tile_order.py`), spare entries -1;
- the write plan (`metadata.build_write_plan`'s, entry for entry): completed blocks up to
  tokens // bs + rows (spares: page -1, skipped), leftover rows up to rows x (bs - 1) (spares:
  residual row -1, skipped);
- the rows that get logits: `rows` of them (spares: row 0).
Decode rows (one new token) run in the same prefill kernel, each a tile of its own, reading its
pages in place; no page is staged (a graph cannot size the workspace).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvmesh.kernels.backend import AttentionMetadata, WritePlan
from kvmesh.kernels.metadata import SeqSlice
from kvmesh.kernels.tile_order import tile_list

if TYPE_CHECKING:
    from kvmesh.engine.inflight import TokenFeed


@dataclass(frozen=True)
class ChunkShape:
    """The fixed shape of one captured prompt step."""

    tokens: int
    """New-token rows of the step (real ones first, then padding)."""
    rows: int
    """Sequences (real ones first, then padding with no new token)."""
    table_width: int
    """Block-table columns: pages of the longest context a graph serves."""
    block_size: int
    num_slots: int
    """Residual slots in the cache (the write plan's rows of S start after them)."""
    scratch_slot: int
    """The padding sequences' residual slot (owned by no sequence; nothing reads or writes it here)."""
    tile_tokens: int
    """New tokens a prefill tile holds (`paged_attention.tile_tokens`)."""

    @property
    def blocks(self) -> int:
        """Completed-block capacity: a sequence completes at most its new tokens // bs + 1."""
        return self.tokens // self.block_size + self.rows

    @property
    def leftovers(self) -> int:
        """Leftover-row capacity: a sequence leaves fewer than bs rows in its residual slot."""
        return min(self.tokens, self.rows * (self.block_size - 1))

    @property
    def tiles(self) -> int:
        """Tile-list capacity: a sequence's tiles are at most its new tokens // tile + 1."""
        return self.tokens // self.tile_tokens + self.rows


class ChunkBatch:
    """Host staging buffers and their device twins for one `ChunkShape`; `fill` then `metadata`."""

    def __init__(self, shape: ChunkShape, device: torch.device) -> None:
        self.shape = shape
        t, n, w, bs, nb = shape.tokens, shape.rows, shape.table_width, shape.block_size, shape.blocks
        # int64: ids [t] | positions [t] | residual src | residual dst | logit rows [n] | block ids [nb] |
        # block rows [nb, bs]
        self._sizes64 = (t, t, shape.leftovers, shape.leftovers, n, nb, nb * bs)
        self._host64 = torch.zeros(sum(self._sizes64), dtype=torch.int64)
        # int32: query start [n + 1] | prefix lens [n] | residual slots [n] | tiles | block tables [n, w]
        self._sizes32 = (n + 1, n, n, shape.tiles, n * w)
        self._host32 = torch.zeros(sum(self._sizes32), dtype=torch.int32)
        if device.type == "cuda":  # one copy each a step, not waiting on a pageable staging copy
            self._host64, self._host32 = self._host64.pin_memory(), self._host32.pin_memory()
        self._dev64 = torch.zeros_like(self._host64, device=device)
        self._dev32 = torch.zeros_like(self._host32, device=device)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        (self.input_ids, self.positions, self._res_src, self._res_dst, self.logit_rows, self._block_ids,
         self._block_rows) = _parts(self._dev64, self._sizes64)
        self.fill([], [], [])

    def fill(self, chunks: list[list[int]], seqs: list[SeqSlice], sample_rows: list[int],
             feed: TokenFeed | None = None) -> None:
        """Stages one step (chunks[i]: sequence i's new tokens, laid out in order; `sample_rows`: the
        rows that get logits) and copies it to the device buffers, in stream order. `feed`: tokens
        still on the device, written over their rows' placeholders after the copy."""
        s = self.shape
        t, n, w, bs = s.tokens, s.rows, s.table_width, s.block_size
        b = len(seqs)
        lens = np.array([x.num_new for x in seqs], dtype=np.int64)  # [b]
        real = int(lens.sum())
        if b > n or real > t or len(sample_rows) > n:
            raise ValueError(f"{b} sequences of {real} new tokens do not fit a prompt step of {n} and {t}")
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the pinned buffers is done
        ids, pos, res_src, res_dst, logit_rows, block_ids, block_rows = _parts(self._host64.numpy(), self._sizes64)
        qstart, prefix, slots, tiles, tables = _parts(self._host32.numpy(), self._sizes32)
        block_rows = block_rows.reshape(-1, bs)
        tables = tables.reshape(n, w)
        p = np.array([x.prefix_len for x in seqs], dtype=np.int64)  # [b]
        r = np.array([x.residual_slot for x in seqs], dtype=np.int64)  # [b]
        starts = np.concatenate([[0], np.cumsum(lens)])  # [b + 1]
        qstart[:b + 1], qstart[b + 1:] = starts, real
        prefix[:] = 0
        prefix[:b] = p
        slots[:] = s.scratch_slot
        slots[:b] = r
        ids[:] = 0
        ids[:real] = [tok for c in chunks for tok in c]
        seq = np.repeat(np.arange(b), lens)  # [real] each row's sequence
        new_pos = p[seq] + np.arange(real) - starts[seq]  # [real] each row's position
        pos[:] = 0
        pos[:real] = new_pos
        new_base = s.num_slots * bs  # the step's new rows follow the residual rows in S
        # completed blocks: first .. last - 1 of each sequence, rows from its tail or its new rows
        first, last = p // bs, (p + lens) // bs
        counts = last - first
        blk_seq = np.repeat(np.arange(b), counts)  # [nb] each block's sequence
        blk = first[blk_seq] + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        at = blk[:, None] * bs + np.arange(bs)[None, :]  # [nb, bs] positions of the blocks' rows
        ps = p[blk_seq][:, None]
        rows = np.where(at < ps, (r[blk_seq] * bs)[:, None] + at % bs, new_base + starts[blk_seq][:, None] + at - ps)
        nb = rows.shape[0]
        block_ids[:] = -1
        block_rows[:] = 0
        block_rows[:nb] = rows
        for i, x in enumerate(seqs):
            tables[i, :min(len(x.block_table), w)] = x.block_table[:w]
        block_ids[:nb] = tables[blk_seq, blk]
        # leftover rows: past the last completed block, to the sequence's residual slot
        tail = new_pos >= np.maximum(p, last * bs)[seq]  # [real]
        src = new_base + np.flatnonzero(tail)
        m = src.shape[0]
        res_src[:] = new_base
        res_src[:m] = src
        res_dst[:] = -1
        res_dst[:m] = r[seq[tail]] * bs + new_pos[tail] % bs
        work = tile_list(p, lens, s.tile_tokens)
        tiles[:] = -1
        tiles[:work.shape[0]] = work
        logit_rows[:] = 0
        logit_rows[:len(sample_rows)] = sample_rows
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32.copy_(self._host32, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if feed is not None:
            feed.apply(self.input_ids)

    def metadata(self) -> AttentionMetadata:
        """The step's metadata over the device buffers (the kernels see the bucket's shapes only)."""
        s = self.shape
        qstart, prefix, slots, tiles, tables = _parts(self._dev32, self._sizes32)
        write = WritePlan(block_rows=self._block_rows.view(-1, s.block_size), block_ids=self._block_ids,
                          residual_src=self._res_src, residual_dst=self._res_dst)
        return AttentionMetadata(query_start_loc=qstart, prefix_lens=prefix,
                                 block_tables=tables.view(s.rows, s.table_width), residual_slots=slots,
                                 max_query_len=s.tokens, max_prefix_len=s.table_width * s.block_size,
                                 write=write, tiles=tiles)


def _parts(x, sizes: tuple[int, ...]) -> list:
    """Consecutive views of x (a tensor or an array) of the given sizes."""
    out, at = [], 0
    for size in sizes:
        out.append(x[at:at + size])
        at += size
    return out
