"""The prefill kernel's tile list for a CUDA graph's fixed-capacity launch (`AttentionMetadata.tiles`):
every tile of a step once, the heaviest first.

A tile's work is the keys it reads: its sequence's prefix plus the new tokens up to its last row.
Dispatching the heaviest tiles first (longest processing time first) leaves the light ones to fill
the SMs at the end, where one long tile dispatched last would run alone. The kernel runs an entry's
KV heads as adjacent programs, so the order holds across heads too.
"""
from __future__ import annotations

import numpy as np


def tile_list(prefix_lens: np.ndarray, new_lens: np.ndarray, tile_tokens: int) -> np.ndarray:
    """int64 [n] entries b << 16 | tile for sequences of `prefix_lens` [B] cached and `new_lens` [B]
    new tokens, `tile_tokens` new tokens a tile: heaviest first, ties in sequence then tile order."""
    prefix_lens, new_lens = np.asarray(prefix_lens, np.int64), np.asarray(new_lens, np.int64)
    per = -(-new_lens // tile_tokens)  # [B] tiles of each sequence
    seq = np.repeat(np.arange(new_lens.shape[0]), per)  # [n]
    tile = np.arange(seq.shape[0]) - np.repeat(np.cumsum(per) - per, per)  # [n]
    keys = prefix_lens[seq] + np.minimum((tile + 1) * tile_tokens, new_lens[seq])  # [n] keys of its last row
    order = np.argsort(-keys, kind="stable")
    return (seq[order] << 16) | tile[order]
