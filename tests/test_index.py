"""PrefixIndex backends: MemoryIndex and RedisIndex (a real redis-server) behave the same."""
from __future__ import annotations

import os

import pytest

from kvmesh.index import MemoryIndex, PrefixIndex, RedisIndex, make_index


def rand_hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


@pytest.fixture(params=["memory", "redis"])
async def index(request) -> PrefixIndex:
    if request.param == "memory":
        idx = MemoryIndex()
    else:
        idx = RedisIndex(request.getfixturevalue("redis_flush"), ttl_seconds=60)
    yield idx
    await idx.close()


async def test_lookup_reports_holders_in_order(index):
    a, b, c, d = rand_hashes(4)
    await index.publish("10.0.0.1:50061", [a, b], [])
    await index.publish("10.0.0.2:50061", [b, c], [])
    got = await index.lookup([a, b, c, d])
    assert got == [frozenset({"10.0.0.1:50061"}), frozenset({"10.0.0.1:50061", "10.0.0.2:50061"}),
                   frozenset({"10.0.0.2:50061"}), frozenset()]
    assert await index.lookup([]) == []
    assert await index.lookup(rand_hashes(3)) == [frozenset()] * 3  # nothing held at all


async def test_removed_and_drop_holder(index):
    hs = rand_hashes(5)
    await index.publish("n1:1", hs, [])
    await index.publish("n2:2", hs[:2], [])
    await index.publish("n1:1", [], hs[:3])
    assert await index.lookup(hs) == [frozenset({"n2:2"})] * 2 + [frozenset()] + [frozenset({"n1:1"})] * 2
    await index.drop_holder("n1:1")
    assert await index.lookup(hs) == [frozenset({"n2:2"})] * 2 + [frozenset()] * 3
    await index.drop_holder("n2:2")
    assert await index.lookup(hs) == [frozenset()] * 5


async def test_stale_and_unknown_removals_are_harmless(index):
    a, b = rand_hashes(2)
    await index.publish("gone:1", [], [a])  # a holder never seen, a block never stored
    await index.publish("n:1", [b], [])
    await index.publish("n:1", [b], [])  # a re-publish is idempotent
    await index.publish("n:1", [], [a])  # removing what n:1 never held leaves b alone
    assert await index.lookup([a, b]) == [frozenset(), frozenset({"n:1"})]
    await index.drop_holder("never-published:9")


async def test_256_hash_lookup(index):
    hs = rand_hashes(256)
    await index.publish("w:9", hs[::2], [])
    got = await index.lookup(hs)
    assert got == [frozenset({"w:9"}) if i % 2 == 0 else frozenset() for i in range(256)]


async def test_redis_keys_ttl_and_cleanup(redis_flush):
    import redis.asyncio as aioredis

    idx = RedisIndex(redis_flush, namespace="t", ttl_seconds=77)
    raw = aioredis.Redis.from_url(redis_flush)
    try:
        a, b = rand_hashes(2)
        await idx.publish("h:1", [a, b], [])
        assert await raw.smembers(f"t:blk:{a.hex()}") == {b"h:1"}
        assert 0 < await raw.ttl(f"t:blk:{a.hex()}") <= 77
        assert await raw.smembers("t:holder:h:1") == {a.hex().encode(), b.hex().encode()}
        await idx.publish("h:1", [], [a])
        assert not await raw.exists(f"t:blk:{a.hex()}")  # last holder gone: key deleted
        await idx.drop_holder("h:1")
        assert await raw.keys("t:*") == []
    finally:
        await raw.aclose()
        await idx.close()


async def test_redis_rejects_mixed_hash_lengths(redis_flush):
    idx = RedisIndex(redis_flush)
    try:
        with pytest.raises(ValueError, match="one non-zero length"):
            await idx.lookup([b"short", os.urandom(32)])
    finally:
        await idx.close()


def test_make_index():
    assert isinstance(make_index(None), MemoryIndex)
    assert isinstance(make_index(""), MemoryIndex)
    assert isinstance(make_index("redis://127.0.0.1:1/0"), RedisIndex)
    with pytest.raises(ValueError, match="--redis-url"):
        make_index("ftp://x")
