"""IndexFeed against a real redis-server: an outage is logged once and retried with backoff, and
when Redis comes back empty the whole held set is published again; held blocks are republished
before their Redis TTL runs out; a big held set goes in chunks."""
from __future__ import annotations

import logging
import os

import pytest
import redis.asyncio as aredis

from kvmesh.index import MemoryIndex, RedisIndex
from kvmesh.index_feed import CHUNK_HASHES, MAX_BACKOFF_S, IndexFeed
from redis_server import RedisServer

INTERVAL = 0.05


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingRedisIndex(RedisIndex):
    def __init__(self, url: str, **kw) -> None:
        super().__init__(url, **kw)
        self.calls = 0

    async def publish(self, holder, stored, removed) -> None:
        self.calls += 1
        await super().publish(holder, stored, removed)

    async def drop_holder(self, holder) -> None:
        self.calls += 1
        await super().drop_holder(holder)


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


async def test_an_outage_is_logged_once_backed_off_and_repaired_by_a_full_republish(redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="kvmesh.index_feed")
    index, clock = CountingRedisIndex(redis_server.url), Clock()
    held: set[bytes] = set()
    feed = IndexFeed(index, "w:1", lambda: held, "decode", INTERVAL, clock=clock)

    def hold(h: bytes, yes: bool = True) -> None:
        (held.add if yes else held.discard)(h)
        feed.note(h, yes)

    before = [os.urandom(32) for _ in range(3)]
    for h in before:
        hold(h)
    await feed.tick()
    assert await index.lookup(before) == [frozenset({"w:1"})] * 3

    redis_server.crash()
    during = [os.urandom(32) for _ in range(2)]
    for h in during:
        hold(h)
    hold(before[0], False)
    calls = index.calls
    for _ in range(200):  # 10 s of ticks
        clock.now += INTERVAL
        await feed.tick()
    assert feed.index_down
    assert 3 <= index.calls - calls <= 10, index.calls - calls  # backoff up to MAX_BACKOFF_S, not 200 tries
    assert len(caplog.records) == 1, caplog.text  # one line for the outage

    redis_server.start(port=redis_server.port)  # back, empty
    clock.now += MAX_BACKOFF_S
    await feed.tick()
    assert not feed.index_down
    assert await index.lookup(before[1:] + during) == [frozenset({"w:1"})] * 4  # held before the outage too
    assert await index.lookup(before[:1]) == [frozenset()]
    assert len(caplog.records) == 2 and "answers again" in caplog.records[1].getMessage()
    calls = index.calls
    clock.now += INTERVAL
    await feed.tick()
    assert index.calls == calls  # back to changes only: none
    await index.close()


async def test_held_blocks_are_republished_before_their_ttl_runs_out(redis_server):
    index, clock = RedisIndex(redis_server.url, ttl_seconds=30), Clock()
    held = {os.urandom(32) for _ in range(2)}
    feed = IndexFeed(index, "kv:1", lambda: held, "kvstore", INTERVAL, clock=clock)
    assert feed.refresh_s == 10
    for h in held:
        feed.note(h, True)
    await feed.tick()
    r = aredis.Redis.from_url(redis_server.url)
    keys = [index.block_key(h) for h in held] + [index.holder_key("kv:1")]
    for k in keys:  # as if 28 s had passed in Redis
        await r.expire(k, 2)
    clock.now += 9.9
    await feed.tick()  # not due yet: nothing sent
    assert [await r.ttl(k) for k in keys] == [2, 2, 2]
    clock.now += 0.2
    await feed.tick()
    ttls = [await r.ttl(k) for k in keys]
    assert min(ttls) > 20, ttls
    await r.aclose()
    await index.close()


class RecordingIndex(MemoryIndex):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[int, int]] = []
        self.down = False

    async def publish(self, holder, stored, removed) -> None:
        if stored or removed:  # MemoryIndex.drop_holder comes through here too
            self.sizes.append((len(stored), len(removed)))
        if self.down:
            raise ConnectionError("index unreachable")
        await super().publish(holder, stored, removed)


async def test_a_big_held_set_is_republished_in_chunks():
    index = RecordingIndex()
    held = [os.urandom(32) for _ in range(2 * CHUNK_HASHES + 5)]
    feed = IndexFeed(index, "kv:1", lambda: held, "kvstore", INTERVAL)
    index.down = True
    feed.note(held[0], True)
    with pytest.raises(ConnectionError):
        await feed.flush()
    index.down = False
    index.sizes.clear()
    assert await feed.flush() == len(held)
    assert index.sizes == [(CHUNK_HASHES, 0), (CHUNK_HASHES, 0), (5, 0)]
    assert all(await index.lookup(held))


async def test_a_holder_restarted_under_its_name_withdraws_what_the_killed_one_left(redis_server):
    index = RedisIndex(redis_server.url)
    left = [os.urandom(32) for _ in range(2)]
    killed = IndexFeed(index, "kv:1", lambda: left, "kvstore", INTERVAL)
    await killed.tick()  # and then SIGKILL: no goodbye, its entries stay
    held = [os.urandom(32)]
    restarted = IndexFeed(index, "kv:1", lambda: held, "kvstore", INTERVAL)
    await restarted.tick()
    assert await index.lookup(left + held) == [frozenset(), frozenset(), frozenset({"kv:1"})]
    await index.close()
