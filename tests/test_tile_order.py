"""The prefill kernel's tile list for CUDA graphs: every tile once, the most keys first; the kernel
over such a list against torch."""
import dataclasses

import numpy as np
import pytest
import torch

from kvmesh.kernels.paged_attention import PREFILL_BLOCK_M, tile_tokens
from kvmesh.kernels.prefill_attention import prefill_attention
from kvmesh.kernels.tile_order import tile_list
from test_kernels_attention import check


def test_every_tile_once_heaviest_first():
    rng = np.random.default_rng(7)
    for _ in range(20):
        b = int(rng.integers(1, 12))
        prefix = rng.integers(0, 3000, b)
        new = rng.integers(1, 700, b)
        new[rng.random(b) < 0.3] = 1  # decode rows: one tile of one token
        entries = tile_list(prefix, new, 42)
        seq, tile = entries >> 16, entries & 0xFFFF
        want = sorted((s, t) for s in range(b) for t in range(-(-int(new[s]) // 42)))
        assert sorted(zip(seq.tolist(), tile.tolist())) == want
        keys = prefix[seq] + np.minimum((tile + 1) * 42, new[seq])
        assert (np.diff(keys) <= 0).all()


def test_ties_keep_sequence_then_tile_order():
    # a decode row over 100 keys ties a fresh prompt's second tile (100 keys): the sequence first wins
    assert tile_list([99, 0], [1, 150], 50).tolist() == [1 << 16 | 2, 0, 1 << 16 | 1, 1 << 16 | 0]


def test_no_sequences():
    assert tile_list([], [], 64).shape == (0,)


def attend_over_tile_list(cache, layer, q, k, v, meta, scale, block_m=PREFILL_BLOCK_M, **kw):
    """The prefill kernel over a prompt graph's tile list: heaviest first, 3 spare entries."""
    G = q.shape[1] // cache.layout.kv_heads
    entries = tile_list(meta.prefix_lens.cpu().numpy(), meta.query_start_loc.diff().cpu().numpy(),
                        tile_tokens(G, block_m)).tolist() + [-1] * 3
    listed = dataclasses.replace(meta, stage=None, tiles=torch.tensor(entries, dtype=torch.int32, device=q.device))
    return prefill_attention(cache, layer, q, k, v, listed, scale, block_m=block_m, staging=False, **kw)


def test_prefill_tile_list():
    # decode rows and chunks over prefixes, a fresh chunk: tiles of 4 tokens, KV heads adjacent
    check("int8", 4, 64, 16, [20, 0, 35], [1, 13, 6],
          attend=lambda *a: attend_over_tile_list(*a, block_m=16, block_n=16, num_warps=4, num_stages=1))


@pytest.mark.gpu
@pytest.mark.parametrize("kv,gqa,head_dim,kv_heads", [("int4", 3, 64, 3), ("fp16", 3, 64, 3),
                                                      ("fp8_e4m3", 4, 128, 8), ("int8", 4, 128, 8)])
def test_gpu_prefill_tile_list(kv, gqa, head_dim, kv_heads):
    # a prompt graph's mix at SmolLM2's and Llama-3-8B's heads: decode rows over long prefixes,
    # chunks over prefixes, fresh prompts; the tile list heaviest first, and the eager grid
    lens, new = [1000, 3000, 0, 2049, 700, 0, 17], [1, 300, 1500, 1, 40, 777, 1]
    kw = dict(kv_heads=kv_heads, device="cuda", model_dtype=torch.float16)
    check(kv, gqa, head_dim, 16, lens, new, attend=attend_over_tile_list, **kw)
    check(kv, gqa, head_dim, 16, lens, new, attend=prefill_attention, **kw)
