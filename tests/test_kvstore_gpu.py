"""BlockStore with its pool in GPU memory (run on the H200 machine): bytes survive the round trip,
eviction order and the host tier work the same as on the CPU."""
from __future__ import annotations

import os

import pytest

from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.store import BlockStore, PutResult

pytestmark = pytest.mark.gpu


def test_gpu_pool_round_trip_lru_and_host_tier():
    import torch

    slot = 1 << 20
    store = BlockStore(KVStoreConfig(capacity_blocks=4, block_bytes=slot, host_tier_bytes=2 * slot, device="cuda",
                                     high_watermark=1.0, low_watermark=0.75))
    assert store.device == "cuda" and store._primary.slab.view(0, 16).is_cuda
    before = torch.cuda.memory_allocated()
    blocks = [(os.urandom(32), os.urandom(slot - 17 * i), list(range(i, i + 16))) for i in range(6)]
    for h, d, t in blocks:
        assert store.put(h, d, t, "L") is PutResult.STORED
    assert torch.cuda.memory_allocated() == before  # no allocation per block: the pool is preallocated
    hs = [h for h, _, _ in blocks]
    assert store.lru_order() == hs[2:] and store.lru_order("host") == hs[:2]
    for h, d, t in blocks:
        got = store.get(h)
        assert got.data == d and got.token_ids == t
    s = store.stats()
    assert (s.blocks_promoted, s.blocks_demoted, s.blocks_evicted) == (6, 8, 0)  # cyclic reads thrash LRU
    store.check_integrity()
