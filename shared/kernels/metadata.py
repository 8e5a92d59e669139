"""Builds one step's `AttentionMetadata` (and its `WritePlan`) from per-sequence slices.

The runner describes each scheduled sequence with a `SeqSlice`; this module does the index math once
per step (on the CPU, in Python over sequences and vectorized over tokens) and moves the result to the
device. Row numbering of the write plan: S = cat(residual rows [num_slots * bs], new rows [T]),
residual row = slot * bs + offset inside the tail block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.kernels.backend import AttentionMetadata, MixedSplit, PrefixStage, WritePlan
from kvmesh.kernels.work_list import BatchContexts
from kvmesh.kv.layout import BlockLayout


@dataclass
class SeqSlice:
    """One sequence's part of a step."""

    prefix_len: int
    """Tokens already cached before this step (full pages + residual tail)."""
    num_new: int
    """Tokens computed this step (prompt chunk, or 1 for decode)."""
    block_table: list[int] = field(default_factory=list)
    """Page ids of the sequence's blocks in order; must cover every full block of prefix + new."""
    residual_slot: int = 0
    """The sequence's residual slot (its partial tail block, full precision)."""


@dataclass(frozen=True)
class StagePolicy:
    """Which sequences' full prefix pages a step stages into the fp16 workspace (`PrefixStage`)."""

    min_new_tokens: int = 128
    """Chunks at least this long: they span several query tiles, each of which would dequantize
    the whole prefix again (a decode row or a short extend reads its pages once anyway)."""
    max_bytes: int = 256 << 20
    """Workspace bound (fp16 K and V of one layer); sequences past it are read in place."""


NO_STAGING = StagePolicy(min_new_tokens=1 << 62, max_bytes=0)


def _check(i: int, s: SeqSlice, bs: int, num_residual_slots: int) -> None:
    if s.prefix_len < 0:
        raise ValueError(f"seqs[{i}].prefix_len must be >= 0, got {s.prefix_len}")
    if s.num_new < 1:
        raise ValueError(f"seqs[{i}].num_new must be >= 1, got {s.num_new}")
    if not 0 <= s.residual_slot < num_residual_slots:
        raise ValueError(f"seqs[{i}].residual_slot must be in [0, {num_residual_slots}), got {s.residual_slot}")
    need = (s.prefix_len + s.num_new) // bs
    if len(s.block_table) < need or any(b < 0 for b in s.block_table[:need]):
        raise ValueError(f"seqs[{i}].block_table has {len(s.block_table)} pages, needs {need} valid "
                         f"page ids for {s.prefix_len} + {s.num_new} tokens at block size {bs}")


def build_write_plan(seqs: list[SeqSlice], block_size: int, num_residual_slots: int,
                     query_start: list[int]) -> WritePlan:
    """The write plan on the CPU: completed blocks (residual + new rows) and leftover tail rows."""
    bs = block_size
    new_base = num_residual_slots * bs  # first new row in S
    rows: list[torch.Tensor] = []
    ids: list[int] = []
    res_src: list[torch.Tensor] = []
    res_dst: list[torch.Tensor] = []
    for s, qs in zip(seqs, query_start):
        p, end = s.prefix_len, s.prefix_len + s.num_new
        first, last = p // bs, end // bs  # blocks first .. last-1 complete this step
        if last > first:
            pos = torch.arange(first * bs, last * bs, dtype=torch.int64).view(-1, bs)  # [nb, bs]
            from_res = s.residual_slot * bs + pos % bs
            from_new = new_base + qs + (pos - p)
            rows.append(torch.where(pos < p, from_res, from_new))
            ids.extend(s.block_table[first:last])
        tail_start = max(p, last * bs)
        if end > tail_start:
            pos = torch.arange(tail_start, end, dtype=torch.int64)
            res_src.append(new_base + qs + (pos - p))
            res_dst.append(s.residual_slot * bs + pos % bs)
    block_rows = torch.cat(rows) if rows else torch.empty(0, bs, dtype=torch.int64)
    return WritePlan(
        block_rows=block_rows,
        block_ids=torch.tensor(ids, dtype=torch.int64),
        residual_src=torch.cat(res_src) if res_src else torch.empty(0, dtype=torch.int64),
        residual_dst=torch.cat(res_dst) if res_dst else torch.empty(0, dtype=torch.int64),
    )


def pad_write_plan(plan: WritePlan, num_blocks: int) -> WritePlan:
    """Pads the completed-block list to `num_blocks` entries with id -1 (fixed shapes, e.g. for
    CUDA graphs); backends skip -1 blocks."""
    extra = num_blocks - int(plan.block_ids.shape[0])
    if extra < 0:
        raise ValueError(f"num_blocks={num_blocks} is less than the {plan.block_ids.shape[0]} blocks completed")
    bs = plan.block_rows.shape[1]
    dev = plan.block_rows.device
    return WritePlan(
        block_rows=torch.cat([plan.block_rows, torch.zeros(extra, bs, dtype=torch.int64, device=dev)]),
        block_ids=torch.cat([plan.block_ids, torch.full((extra,), -1, dtype=torch.int64, device=dev)]),
        residual_src=plan.residual_src, residual_dst=plan.residual_dst)


def build_prefix_stage(seqs: list[SeqSlice], layout: BlockLayout, width: int,
                       policy: StagePolicy) -> PrefixStage | None:
    """The pages (on the CPU) of the sequences `policy` stages, or None.
    fp16 and fp32 pages are read as they are (nothing to dequantize)."""
    if layout.kv_dtype in ("fp16", "fp32"):
        return None
    page_bytes = 2 * layout.kv_heads * layout.block_size * layout.head_dim * 2
    budget = policy.max_bytes // page_bytes
    src: dict[int, int] = {}  # pool page -> workspace page
    rows: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        full = s.block_table[:s.prefix_len // layout.block_size]
        if s.num_new < policy.min_new_tokens or not full:
            continue
        fresh = [p for p in dict.fromkeys(full) if p not in src]
        if len(src) + len(fresh) > budget:
            continue  # this one stays in place
        for p in fresh:
            src[p] = len(src)
        rows[i] = [src[p] for p in full]
    if not rows:
        return None
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for i, r in rows.items():
        tables[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    every = all(i in rows for i, s in enumerate(seqs) if s.prefix_len >= layout.block_size)
    return PrefixStage(torch.tensor(list(src), dtype=torch.int32), tables, every)


def _attention_fields(seqs: list[SeqSlice], layout: BlockLayout, dev: torch.device, stage: StagePolicy,
                      write: WritePlan) -> AttentionMetadata:
    query_start = [0]
    for s in seqs:
        query_start.append(query_start[-1] + s.num_new)
    width = max(1, max(len(s.block_table) for s in seqs))
    table = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for i, s in enumerate(seqs):
        if s.block_table:
            table[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    staged = build_prefix_stage(seqs, layout, width, stage)
    return AttentionMetadata(
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
        prefix_lens=torch.tensor([s.prefix_len for s in seqs], dtype=torch.int32, device=dev),
        block_tables=table.to(dev),
        residual_slots=torch.tensor([s.residual_slot for s in seqs], dtype=torch.int32, device=dev),
        max_query_len=max(s.num_new for s in seqs),
        max_prefix_len=max(s.prefix_len for s in seqs),
        contexts=BatchContexts.of([s.prefix_len + 1 for s in seqs]) if all(s.num_new == 1 for s in seqs) else None,
        write=write,
        stage=None if staged is None else PrefixStage(staged.src_pages.to(dev), staged.tables.to(dev),
                                                      staged.every),
    )


def _rows(rows: list[int], dev: torch.device) -> slice | torch.Tensor:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=dev)


def _split_mixed(seqs: list[SeqSlice], layout: BlockLayout, dev: torch.device, stage: StagePolicy,
                 query_start: list[int]) -> MixedSplit | None:
    dec = [i for i, s in enumerate(seqs) if s.num_new == 1]
    rest = [i for i, s in enumerate(seqs) if s.num_new > 1]
    if not dec or not rest:
        return None
    bs = layout.block_size
    none = WritePlan(torch.empty(0, bs, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                     torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    prefill_rows = [r for i in rest for r in range(query_start[i], query_start[i + 1])]
    return MixedSplit(_rows([query_start[i] for i in dec], dev),
                      _attention_fields([seqs[i] for i in dec], layout, dev, stage, none),
                      _rows(prefill_rows, dev),
                      _attention_fields([seqs[i] for i in rest], layout, dev, stage, none))


def build_attention_metadata(seqs: list[SeqSlice], layout: BlockLayout, num_residual_slots: int,
                             device: torch.device | str = "cpu", stage: StagePolicy = StagePolicy(),
                             split_mixed: bool = False) -> AttentionMetadata:
    """One step's metadata. New tokens of the batch are laid out sequence after sequence, in order.
    `split_mixed`: a step of decode rows and longer chunks also carries its two parts (`MixedSplit`)."""
    if not seqs:
        raise ValueError("seqs must not be empty")
    bs = layout.block_size
    for i, s in enumerate(seqs):
        _check(i, s, bs, num_residual_slots)
    query_start = [0]
    for s in seqs:
        query_start.append(query_start[-1] + s.num_new)
    plan = build_write_plan(seqs, bs, num_residual_slots, query_start[:-1])
    dev = torch.device(device)
    write = WritePlan(plan.block_rows.to(dev), plan.block_ids.to(dev), plan.residual_src.to(dev),
                      plan.residual_dst.to(dev))
    mixed = _split_mixed(seqs, layout, dev, stage, query_start) if split_mixed else None
    # a split step stages in its prefill part, not twice
    meta = _attention_fields(seqs, layout, dev, NO_STAGING if mixed else stage, write)
    meta.mixed = mixed
    return meta
