"""IndexBreaker: a lookup waits at most --index-timeout, a failure opens the breaker (lookups skipped,
misses at once) for a backoff that doubles, one lookup then tries again, one warning an outage."""
from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest

from kvmesh.gateway.index_breaker import FIRST_BACKOFF_S, MAX_BACKOFF_S, IndexBreaker
from kvmesh.index import MemoryIndex

HASHES = [os.urandom(32) for _ in range(3)]
MISS = [frozenset()] * 3


class SickIndex(MemoryIndex):
    """A real memory index that, while `state` says so, hangs or refuses; counts lookups."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "ok"  # ok | hang | refuse
        self.lookups = 0

    async def lookup(self, hashes):
        self.lookups += 1
        if self.state == "hang":
            await asyncio.Event().wait()
        if self.state == "refuse":
            raise ConnectionRefusedError("Connection refused")
        return await super().lookup(hashes)


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def index():
    idx = SickIndex()
    await idx.publish("w:1", HASHES[:2], [])
    return idx


async def test_a_hung_index_costs_one_timeout_then_lookups_are_skipped(index, caplog):
    caplog.set_level(logging.WARNING, logger="kvmesh.gateway")
    reasons: list[str] = []
    clock = Clock()
    breaker = IndexBreaker(index, 0.05, reasons.append, clock=clock)
    assert await breaker.lookup(HASHES) == [frozenset({"w:1"})] * 2 + [frozenset()]

    index.state = "hang"
    t0 = time.monotonic()
    assert await breaker.lookup(HASHES) == MISS
    assert time.monotonic() - t0 < 1.0  # --index-timeout, not redis-py's socket timeout
    for _ in range(100):  # inside the backoff: the index is left alone
        assert await breaker.lookup(HASHES) == MISS
    assert index.lookups == 2 and breaker.open
    assert reasons == ["timeout"] + ["skipped"] * 100

    index.state = "ok"
    clock.now += FIRST_BACKOFF_S
    assert await breaker.lookup(HASHES) == [frozenset({"w:1"})] * 2 + [frozenset()]
    assert not breaker.open
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "--index-timeout" in messages[0] and "answers again" in messages[1]


async def test_the_backoff_doubles_while_the_index_refuses_and_resets_after(index, caplog):
    caplog.set_level(logging.WARNING, logger="kvmesh.gateway")
    clock = Clock()
    breaker = IndexBreaker(index, 1.0, clock=clock)
    index.state = "refuse"
    gaps = []
    for _ in range(7):
        assert await breaker.lookup(HASHES) == MISS
        start = clock.now
        while breaker.open:
            clock.now += 0.25
        gaps.append(clock.now - start)
    assert gaps[:4] == [FIRST_BACKOFF_S * 2 ** i for i in range(4)]
    assert gaps[4:] == [MAX_BACKOFF_S] * 3
    assert len(caplog.records) == 1 and "ConnectionRefusedError" in caplog.records[0].getMessage()

    index.state = "ok"
    assert await breaker.lookup(HASHES) != MISS
    index.state = "refuse"
    await breaker.lookup(HASHES)
    start = clock.now
    while breaker.open:
        clock.now += 0.25
    assert clock.now - start == FIRST_BACKOFF_S  # a new outage starts from the first backoff
