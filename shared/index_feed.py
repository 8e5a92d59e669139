"""IndexFeed: what one holder (a worker, a kvstore node) tells the prefix index, kept true through
index outages and entry lifetimes.

A holder notes each block it starts or stops holding; every tick the feed sends the changes since
the last call in one batch (the latest state of a hash wins). A call that fails keeps its changes
for the next, merged with newer ones, and the holder serves on: the index only steers routing.

Three ways the index drifts from what a holder holds, repaired by sending the whole held set:
- a restart: a holder killed without a goodbye leaves its entries, and the next process under its
  name starts empty. So the feed's first flush withdraws everything published under the name,
  then sends what is held (a sync).
- an outage: Redis without persistence restarts empty, and a call that timed out may or may not
  have landed. So the first call after a failure is a sync too.
- entry lifetimes: Redis entries expire `ttl_seconds` after they were last published, and a block
  held for hours (a hot system prompt) is stored once. So every third of the TTL the feed
  republishes the held set, which renews them.

While the index is unreachable the feed logs once (and once when it answers again) and retries with
backoff up to `MAX_BACKOFF_S`, not every tick: a worker's tick is 50 ms.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable, Iterable

from kvmesh.outage import Outage

log = logging.getLogger(__name__)

INDEX_CALL_TIMEOUT_S = 10.0  # one publish or withdraw; the index answers in milliseconds
MAX_BACKOFF_S = 5.0
CHUNK_HASHES = 8192  # per index call: a big store's refresh is many short Redis scripts, not one long one


class IndexFeed:
    def __init__(self, index: Any, holder: str, held: Callable[[], Iterable[bytes]], name: str, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`held()`: every hash the holder holds now (what a refresh republishes); `name` is the
        holder's role in log lines; `interval` the seconds between its ticks."""
        self.index = index  # kvmesh.index.PrefixIndex
        self.holder = holder
        self._held = held
        self._name = name
        self._clock = clock
        ttl = getattr(index, "ttl_seconds", None)  # RedisIndex's; in-memory indexes keep entries
        self.refresh_s: float = ttl / 3 if ttl else math.inf
        self._refresh_at = clock() + self.refresh_s
        self._changes: dict[bytes, bool] = {}  # hash -> held, not yet in the index
        self._sync = True  # the next flush withdraws what this name published, then sends all held
        self._outage = Outage(2 * interval, MAX_BACKOFF_S, clock)  # tick's failures in a row
        self._lock = asyncio.Lock()  # an explicit flush waits for a batch already in flight

    @property
    def index_down(self) -> bool:
        return self._outage.down

    def note(self, block_hash: bytes, held: bool) -> None:
        self._changes.pop(block_hash, None)  # re-inserted: the dict keeps the order of last changes
        self._changes[block_hash] = held

    def discard_changes(self) -> None:
        """Forget what was not sent (the holder is leaving and withdraws everything)."""
        self._changes.clear()

    async def flush(self) -> int:
        """Send the changes, or the whole held set (a sync first, after a failed call; or where a
        refresh is due); the hashes sent. Raises what the index raised (what was to be sent is sent
        next time)."""
        async with self._lock:
            sync = self._sync
            full = sync or self._clock() >= self._refresh_at
            changes, self._changes = self._changes, {}
            stored = list(self._held()) if full else [h for h, held in changes.items() if held]
            removed = [] if sync else [h for h, held in changes.items() if not held]
            try:
                if sync:
                    await asyncio.wait_for(self.index.drop_holder(self.holder), INDEX_CALL_TIMEOUT_S)
                for i in range(0, max(len(stored), len(removed)), CHUNK_HASHES):
                    await asyncio.wait_for(self.index.publish(self.holder, stored[i:i + CHUNK_HASHES],
                                                              removed[i:i + CHUNK_HASHES]), INDEX_CALL_TIMEOUT_S)
            except BaseException:
                changes.update(self._changes)  # newer notes win
                self._changes = changes
                self._sync = True
                raise
            if full:
                self._sync = False
                self._refresh_at = self._clock() + self.refresh_s
            return len(stored) + len(removed)

    async def tick(self) -> None:
        """One flush a tick while the index answers, fewer (backoff up to MAX_BACKOFF_S) while it
        does not; never raises an Exception."""
        if self._outage.waiting():
            return
        try:
            sent = await self.flush()
        except Exception as e:
            if self._outage.failed():
                log.warning("%s: the prefix index does not answer (%s: %s); serving on without it and "
                            "retrying with backoff; what this holder holds is republished when it answers",
                            self._name, type(e).__name__, e)
            return
        lasted = self._outage.answered()
        if lasted is not None:  # a flush after a failure is a sync: it reached the index
            log.warning("%s: the prefix index answers again after %.1f s; republished %d blocks",
                        self._name, lasted, sent)
