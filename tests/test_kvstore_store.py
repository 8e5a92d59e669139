"""BlockStore: exact LRU order, watermarks, leases (expiry, Contains never renews), host tier, checks."""
from __future__ import annotations

import os
import random
import zlib

import pytest

from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.store import BlockStore, ChecksumError, PutResult


class Clock:
    """A settable clock so lease expiry is tested exactly (real time is covered over gRPC)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock=None, **kw) -> BlockStore:
    kw.setdefault("capacity_blocks", 4)
    kw.setdefault("block_bytes", 4096)
    kw.setdefault("device", "cpu")
    kw.setdefault("high_watermark", 1.0)
    kw.setdefault("low_watermark", 0.5)
    return BlockStore(KVStoreConfig(**kw), clock=clock or Clock())


def blocks(n: int, size: int = 4096) -> list[tuple[bytes, bytes, list[int]]]:
    return [(os.urandom(32), os.urandom(size), [random.randrange(50000) for _ in range(16)]) for _ in range(n)]


def put_all(store: BlockStore, bs) -> None:
    for h, d, t in bs:
        assert store.put(h, d, t, "L1") is PutResult.STORED


def test_round_trip_exact_bytes_and_metadata():
    store = make(capacity_blocks=8)
    bs = blocks(5, 3000)
    put_all(store, bs)
    for h, d, t in bs:
        got = store.get(h)
        assert (got.hash, got.data, got.token_ids, got.layout, got.crc32) == (h, d, t, "L1", zlib.crc32(d))
    assert store.get(os.urandom(32)) is None
    assert store.put(bs[0][0], bs[0][1], bs[0][2], "L1") is PutResult.ALREADY_HELD
    store.check_integrity()


def test_lru_eviction_order_exact():
    store = make()  # 4 slots, evict when a 5th arrives, down to 2
    (a, da, ta), (b, db, tb), (c, dc, tc), (d, dd, td), (e, de, te) = bs = blocks(5)
    put_all(store, bs[:4])
    store.get(a)  # a becomes most recent: order b, c, d, a
    assert store.lru_order() == [b, c, d, a]
    store.drain_events()
    assert store.put(e, de, te, "L1") is PutResult.STORED
    assert store.lru_order() == [d, a, e]
    assert store.drain_events() == ([e], [b, c])
    assert store.contains([a, b, c, d, e]) == [True, False, False, True, True]
    assert store.stats().blocks_evicted == 2
    store.check_integrity()


def test_watermarks():
    store = make(capacity_blocks=10, high_watermark=0.8, low_watermark=0.5)
    bs = blocks(9)
    put_all(store, bs[:8])  # 8 = high watermark: nothing evicted yet
    assert store.stats().blocks_held == 8
    put_all(store, bs[8:])  # would exceed 8: evict down to 5, then insert
    assert store.lru_order() == [h for h, _, _ in bs[3:]]


def test_leased_blocks_survive_eviction_and_leases_expire():
    clock = Clock()
    store = make(clock, lease_seconds=30)
    bs = blocks(8)
    put_all(store, bs[:4])
    a, b = bs[0][0], bs[1][0]
    store.lease([a, b], "decode-1", 10.0)
    put_all(store, bs[4:5])  # evicts the two oldest *unleased* blocks
    assert store.contains([h for h, _, _ in bs[:5]]) == [True, True, False, False, True]
    clock.now += 10.5  # leases run out: the holder died
    put_all(store, bs[5:7])
    assert store.contains([a, b]) == [False, False]


def test_lease_clipped_to_lease_seconds_and_release():
    clock = Clock()
    store = make(clock, lease_seconds=5)
    bs = blocks(5)
    put_all(store, bs[:4])
    store.lease([bs[0][0]], "p", 1000.0)
    clock.now += 5.5  # clipped to --lease-seconds
    assert store.stats().blocks_leased == 0
    store.lease([bs[0][0]], "p", 100.0)
    assert store.release([bs[0][0]], "other") == 0
    assert store.release([bs[0][0]], "p") == 1
    put_all(store, bs[4:])
    assert not store.contains([bs[0][0]])[0]


def test_contains_never_renews_lease_nor_lru():
    clock = Clock()
    store = make(clock)
    bs = blocks(5)
    hs = [h for h, _, _ in bs]
    put_all(store, bs[:4])
    store.lease([hs[0]], "d", 2.0)  # a: least recently used, leased for 2 s
    for _ in range(5):
        clock.now += 1.0
        assert store.contains([hs[0]]) == [True]
    assert store.lru_order() == hs[:4]  # Contains did not touch the LRU order
    assert store.stats().blocks_leased == 0  # expired at +2 s despite the Contains calls
    put_all(store, bs[4:])
    assert store.lru_order() == [hs[2], hs[3], hs[4]]  # a (unleased again) and b went first


def test_get_lease_protects_until_released():
    clock = Clock()
    store = make(clock)
    bs = blocks(5)
    hs = [h for h, _, _ in bs]
    put_all(store, bs[:4])
    store.get(hs[1], "d", 5.0)  # order a c d b; b leased
    store.lease([hs[0]], "d", 5.0)  # a leased without a read: LRU order unchanged
    assert store.lru_order() == [hs[0], hs[2], hs[3], hs[1]]
    put_all(store, bs[4:])  # evict down to 2 unleased-first: c, d go
    assert store.lru_order() == [hs[0], hs[1], hs[4]]


def test_host_tier_demotes_and_promotes():
    store = make(capacity_blocks=4, host_tier_bytes=3 * 4096, high_watermark=1.0, low_watermark=0.75)
    bs = blocks(7)
    hs = [h for h, _, _ in bs]
    put_all(store, bs[:5])  # 5th put evicts a to host tier
    assert store.lru_order() == hs[1:5] and store.lru_order("host") == hs[:1]
    put_all(store, bs[5:7])  # b, c demote
    assert store.lru_order("host") == hs[:3]
    assert store.drain_events()[1] == []  # demotion keeps blocks held: no removed events
    got = store.get(hs[0])  # host hit: promoted, d demoted into the slot a left, tier full
    assert got.data == bs[0][1] and got.token_ids == bs[0][2]
    assert store.lru_order() == hs[4:7] + hs[:1]
    assert store.lru_order("host") == [hs[1], hs[2], hs[3]]
    put_all(store, blocks(1))  # e demotes; host tier full -> its LRU (b) is dropped for good
    assert store.lru_order("host") == [hs[2], hs[3], hs[4]]
    assert store.drain_events()[1] == [hs[1]]
    s = store.stats()
    assert (s.blocks_demoted, s.blocks_promoted, s.blocks_evicted, s.host_tier_blocks) == (5, 1, 1, 3)
    for h, d, t in bs[2:]:
        assert store.get(h).data == d
    store.check_integrity()


def test_everything_leased_rejects():
    store = make()
    bs = blocks(5)
    put_all(store, bs[:4])
    store.lease([h for h, _, _ in bs[:4]], "x", 10)
    h, d, t = bs[4]
    assert store.put(h, d, t, "L1") is PutResult.REJECTED
    assert store.stats().blocks_rejected == 1


def test_bad_input_errors():
    store = make()
    h, d, t = blocks(1)[0]
    with pytest.raises(ChecksumError, match="crc32"):
        store.put(h, d, t, "L1", crc32=zlib.crc32(d) ^ 1)
    with pytest.raises(ValueError, match="--block-bytes"):
        store.put(h, os.urandom(5000), t, "L1")
    assert store.contains([h]) == [False]


def test_sized_on_first_put():
    store = BlockStore(KVStoreConfig(capacity_bytes=10 * 3000, device="cpu"))
    assert store.capacity_blocks == 0
    put_all(store, blocks(2, 3000))
    assert (store.capacity_blocks, store.slot_bytes) == (10, 3000)


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--low-watermark"):
        KVStoreConfig(high_watermark=0.5, low_watermark=0.6)
    with pytest.raises(ValueError, match="--capacity-blocks needs --block-bytes"):
        KVStoreConfig(capacity_blocks=3)
    with pytest.raises(ValueError, match="--lease-seconds"):
        KVStoreConfig(lease_seconds=0)


def test_cli_flags_build_the_config():
    import argparse

    from kvmesh.kvstore.config import add_cli_args, from_args

    args = add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--port", "0", "--capacity-blocks", "8", "--block-bytes", "4096", "--host-tier-bytes", "65536",
         "--high-watermark", "0.9", "--low-watermark", "0.7", "--lease-seconds", "5", "--device", "cpu",
         "--redis-url", "redis://127.0.0.1:6379/0", "--advertise-address", "kv-0:50061", "--metrics-port", "0"])
    c = from_args(args)
    assert (c.capacity_blocks, c.block_bytes, c.host_tier_bytes, c.high_watermark, c.low_watermark) == (
        8, 4096, 65536, 0.9, 0.7)
    assert (c.lease_seconds, c.redis_url, c.holder, c.metrics_port) == (5.0, "redis://127.0.0.1:6379/0",
                                                                        "kv-0:50061", 0)
    store = BlockStore(c)
    assert (store.capacity_blocks, store.stats().host_tier_capacity_blocks) == (8, 16)
