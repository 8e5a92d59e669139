"""Pages computed in one pool, exported as (hash, token ids, bytes), imported into another pool's
prefix cache: a lookup there finds them and attention over them is bit-identical."""
from __future__ import annotations

import random

import pytest
import torch

from kvmesh.hashing import HashContext, block_hashes
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kv.kv_cache_manager import KVCacheManager
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache

torch.set_num_threads(1)
BS, D, KVH, LAYERS = 8, 32, 2, 2


@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e5m2", "int8", "int4"])
def test_exported_pages_import_as_cached_blocks(kv_dtype):
    gen = torch.Generator().manual_seed(len(kv_dtype))
    layout = BlockLayout(LAYERS, KVH, D, BS, kv_dtype)
    ctx = HashContext("m", kv_dtype, BS)
    toks = [random.Random(1).randrange(1000) for _ in range(3 * BS + 3)]
    hashes = block_hashes(toks, ctx)
    src, dst = KVCache(layout, 6, 2, torch.float32), KVCache(layout, 9, 2, torch.float32)
    src_kv, dst_kv = KVCacheManager(6, block_size=BS, num_residual_slots=2), KVCacheManager(9, block_size=BS)
    dst_kv.allocate(4)  # occupy some pages so ids differ between the pools

    # prefill the prompt into src, register its full blocks
    assert src_kv.allocate_slots("r", len(toks))
    seq = SeqSlice(0, len(toks), src_kv.block_table("r"), src_kv.residual_slot("r"))
    meta = build_attention_metadata([seq], layout, 2, "cpu")
    be = TorchBackend()
    for layer in range(LAYERS):
        be.write(src, layer, torch.randn(len(toks), KVH, D, generator=gen),
                 torch.randn(len(toks), KVH, D, generator=gen), meta)
    assert src_kv.cache_full_blocks("r", toks, hashes, len(toks)) == 3
    pages = src.copy_out(src_kv.block_table("r"), src_kv.residual_slot("r")).rows(0)
    exported = [(h, toks[i * BS:(i + 1) * BS], data) for i, (h, data) in enumerate(zip(hashes, pages))]

    ids = []
    for h, t, _ in exported:
        bid = dst_kv.import_block(h, t)
        assert bid is not None and bid >= 4
        ids.append(bid)
    dst.write_pages(ids, [e[2] for e in exported])
    assert dst_kv.import_block(*exported[0][:2]) is None  # already cached
    hits = dst_kv.lookup(hashes, toks)
    assert len(hits) == 3 and dst_kv.num_free_blocks == 5  # imported pages are cached *and* free
    assert [e[0] for e in dst_kv.drain_events()] == ["stored"] * 3

    # one decode-like query over the 3 imported blocks (empty residual) matches the source pool
    q = torch.randn(1, 2 * KVH, D, generator=gen)
    k1, v1 = torch.randn(1, KVH, D, generator=gen), torch.randn(1, KVH, D, generator=gen)
    outs = []
    for cache, table in ((src, src_kv.block_table("r")), (dst, hits)):
        cache.residual.zero_()
        m = build_attention_metadata([SeqSlice(3 * BS, 1, table, 0)], layout, 2, "cpu")
        outs.append(be.attend(cache, 1, q, k1, v1, m, D ** -0.5))
    assert torch.equal(outs[0], outs[1])
