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


def test_gpu_puts_of_a_call_wait_in_the_ring_and_land_in_order():
    """Without reads, puts only stage their bytes (at most half the ring waits, then those rows go
    in one copy); a slot freed by eviction and written again while its first write still waits
    keeps the later bytes; a flush or any read sends what waits."""
    slot = 64 << 10
    store = BlockStore(KVStoreConfig(capacity_blocks=200, block_bytes=slot, device="cuda", high_watermark=1.0,
                                     low_watermark=0.9))
    ring = store._primary.slab._staging
    half = ring.num_rows // 2
    blocks = [(os.urandom(32), os.urandom(slot - i)) for i in range(3 * half + 5)]
    for i, (h, d) in enumerate(blocks):
        store.put(h, d, [i], "L")
        assert 0 < ring.waiting <= half
    store.flush()
    assert ring.waiting == 0
    assert [store.get(h).data for h, _ in blocks[-10:]] == [d for _, d in blocks[-10:]]
    # a full store: each put evicts (no host tier), so slots come back while their writes may wait
    full = BlockStore(KVStoreConfig(capacity_blocks=4, block_bytes=slot, device="cuda", high_watermark=1.0,
                                    low_watermark=0.75))
    last = [(os.urandom(32), os.urandom(slot)) for _ in range(40)]
    for i, (h, d) in enumerate(last):
        full.put(h, d, [i], "L")
    held = [(h, d) for h, d in last if full.contains([h])[0]]
    assert len(held) == 4 and [b.data for b in full.get_many([h for h, _ in held]).blocks()] == [d for _, d in held]
    full.check_integrity()
