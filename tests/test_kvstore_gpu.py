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


def test_gpu_puts_through_the_staging_ring_land_before_any_read():
    """Puts return before their copies finish; every read queued after them sees their bytes, through
    many passes of the pinned ring (rows reused), slots reused by eviction and blocks of every size."""
    import random

    slot = 256 << 10
    store = BlockStore(KVStoreConfig(capacity_blocks=24, block_bytes=slot, device="cuda", high_watermark=1.0,
                                     low_watermark=0.5))
    ring = store._primary.slab._staging
    rng = random.Random(0)
    held: dict[bytes, bytes] = {}
    for i in range(6 * ring.num_rows):
        h, d = os.urandom(32), os.urandom(rng.randint(1, slot))
        assert store.put(h, d, [i], "L") is PutResult.STORED
        held[h] = d
        held = {k: v for k, v in held.items() if store.contains([k])[0]}
        if i % 2:  # the block just put: its copy may still be queued
            assert store.get(h).data == d
        k = rng.choice(list(held))
        assert store.get(k).data == held[k]
        if i % 17 == 0:
            reads = store.get_many(list(held)).blocks()
            assert [b.data for b in reads] == list(held.values())
    store.check_integrity()
