"""The attention backend interface: how the model reads and writes the paged, quantized KV cache.

Semantics shared by every backend (torch on the CPU, Triton on a GPU), per layer and per step:

1. `attend` runs first. Each sequence's new query tokens attend, causally, to
     - its cached prefix: `prefix_lens[i]` tokens = full pages `block_tables[i, :prefix_lens[i] // bs]`
       in the pool (quantized) followed by `prefix_lens[i] % bs` tokens in its residual slot
       (the partial tail block, kept in full precision), and
     - its own new tokens, whose K/V are passed in dense and in full precision.
   Decode is the case where every sequence has exactly one new token.
2. `write` runs after: it completes blocks (residual tokens + new tokens) and quantizes each whole
   block into its page (`WritePlan.block_ids`; -1 = padding, skipped), computing the scales from
   the whole block; the leftover tokens go to the residual slot. Scales are therefore always
   computed over a complete block, and the newest (< block_size) tokens stay in full precision.

Tensors (T = new tokens in the step, B = sequences, H = query heads, KVH = KV heads, D = head_dim):
    q:  [T, H, D]      k, v: [T, KVH, D]      out: [T, H, D]       (model dtype)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvmesh.kernels.work_list import BatchContexts, WorkPlan
from kvmesh.kv.pool import KVCache


@dataclass
class WritePlan:
    """Where this step's new K/V rows go. Indices address the concatenation, per layer,
    S = cat(residual rows [num_slots * bs, KVH, D], new rows [T, KVH, D])."""

    block_rows: torch.Tensor
    """int64 [n_blocks, bs]: rows of S that make up each block completed this step."""
    block_ids: torch.Tensor
    """int64 [n_blocks]: the page each completed block is quantized into (-1 = padding)."""
    residual_src: torch.Tensor
    """int64 [m]: rows of S that stay in full precision..."""
    residual_dst: torch.Tensor
    """int64 [m]: ...and the residual rows (slot * bs + offset) they are copied to."""
    paired: bool = False
    """A decode batch's plan (`DecodeBatch`): m = n, and copy i is new row i's, which completes block
    i where block i has a page. No block then reads a residual row that a copy writes, so one launch
    may do both (`cache_write.write_blocks(..., residual=...)`)."""


@dataclass
class PrefixStage:
    """Full prefix pages that a GPU backend dequantizes once per layer into an fp16 workspace before
    the prefill kernel reads them. Read in place, a page is dequantized again by every query tile
    of its sequence, so this pays for sequences with long chunks (`metadata.StagePolicy`)."""

    src_pages: torch.Tensor
    """int32 [P]: the pool page behind each workspace page (a page that several sequences share is staged once)."""
    tables: torch.Tensor
    """int32 [B, max_blocks]: a staged sequence's full prefix pages as workspace pages; -1 elsewhere
    (whole rows of -1 for the sequences read in place)."""
    every: bool
    """Every sequence with a full prefix page is staged: one launch, no in-place pass."""


@dataclass
class AttentionMetadata:
    """Everything a backend needs about one step's batch; built once per step by the runner."""

    query_start_loc: torch.Tensor
    """int32 [B + 1]: new tokens of sequence i are rows query_start_loc[i]:query_start_loc[i+1]."""
    prefix_lens: torch.Tensor
    """int32 [B]: tokens already cached (pages + residual) before this step."""
    block_tables: torch.Tensor
    """int32 [B, max_blocks]: page ids; entries past a sequence's pages are -1."""
    residual_slots: torch.Tensor
    """int32 [B]: each sequence's residual slot."""
    max_query_len: int
    """Longest new-token run in the batch (1 for a pure decode step)."""
    max_prefix_len: int
    """Longest cached prefix in the batch."""
    write: WritePlan
    stage: PrefixStage | None = None
    """The prefix pages to stage this step, or None (backends without a workspace ignore it; a
    split step carries them in `mixed.prefill`)."""
    mixed: "MixedSplit | None" = None
    """A step of decode rows and longer chunks, split so each part gets its own kernel; or None."""
    contexts: BatchContexts | None = None
    """A ragged decode step's contexts on the host, for its work list (`work_list.py`); None where
    every sequence is as long as the longest, or unknown (one split count for all)."""
    work: WorkPlan | None = None
    """A CUDA graph's work list of fixed capacity, filled on the host before each replay
    (`work_list.fill_fixed`): every decode launch runs over it (partials, second-launch reduction),
    whatever split count it would choose; None: the launch plans its own."""
    tiles: torch.Tensor | None = None
    """int32 [capacity]: a CUDA graph's prefill tile list of fixed capacity (`engine/chunk_batch.py`):
    entry b << 16 | tile is sequence b's tile of `paged_attention.tile_tokens` new tokens, -1 a spare;
    the prefill kernel runs one program per entry (and KV head). None: it tiles every sequence."""

    @property
    def num_seqs(self) -> int:
        return int(self.prefix_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class MixedSplit:
    """A mixed step's two parts: its decode rows (one new token each) for the decode kernel, its
    longer chunks for the prefill kernel. A decode row alone in a prefill tile of 128 rows fills
    G of them and reads its pages without splits. Rows are slices when contiguous (no gather)."""

    decode_rows: slice | torch.Tensor
    """The step's rows (int64 [n] or a slice) of the sequences with one new token..."""
    decode: AttentionMetadata
    """...and their metadata (attention fields only: `write` is empty)."""
    prefill_rows: slice | torch.Tensor
    prefill: AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Returns out [T, H, D]: softmax(q·Kᵀ·scale)·V over prefix + new tokens (causal)."""
        ...

    def write(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor,
              meta: AttentionMetadata) -> None:
        """Quantizes completed blocks into their pages and keeps the tail in the residual slots."""
        ...


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks Triton on a GPU and torch on the CPU."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from kvmesh.kernels.torch_ref import TorchBackend
        return TorchBackend()
    if name == "triton":
        from kvmesh.kernels.triton_backend import TritonBackend
        return TritonBackend()
    raise ValueError(f"--attention-backend must be auto, torch or triton, got {name!r}")
