"""IndexPublisher: the store's stored/removed events into the prefix index, every --publish-interval.

Best effort: the store is the source of truth, so a failed publish is retried (`IndexFeed`: with
backoff, the whole held set once the index answers again, and every third of its TTL) and a lost
one only costs a reader a miss.

Stopping sets a flag as well as cancelling the loop: on Python 3.11 `asyncio.wait_for` (around each
index call below, and inside redis-py >= 8 for its default 5 s socket timeout) returns normally when a
cancel lands just as the call inside it completes (CPython gh-86296, fixed in 3.12), so a loop that
only waits for CancelledError can run on forever and `stop()` would never return.
"""
from __future__ import annotations

import asyncio
import logging

from kvmesh.index import PrefixIndex
from kvmesh.index_feed import INDEX_CALL_TIMEOUT_S, IndexFeed
from kvmesh.kvstore.store import BlockStore

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0  # the loop ends within one index call once it sees the stop flag


class IndexPublisher:
    def __init__(self, store: BlockStore, index: PrefixIndex, holder: str, interval: float) -> None:
        self.store = store
        self.index = index
        self.holder = holder
        self.interval = interval
        self.feed = IndexFeed(index, holder, store.held_hashes, "kvstore", interval)
        self._task: asyncio.Task | None = None
        self._stopping = False  # the loop's exit condition; cancel() alone may be swallowed (see above)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"index-publisher-{self.holder}")

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.interval)
            self._note_events()
            await self.feed.tick()  # the index is advisory: it logs an outage and retries

    def _note_events(self) -> None:
        stored, removed = self.store.drain_events()
        for h in stored:
            self.feed.note(h, True)
        for h in removed:
            self.feed.note(h, False)

    async def flush(self) -> None:
        """Publish everything the store reported since the last flush (and wait for it)."""
        self._note_events()
        await self.feed.flush()

    async def stop(self) -> None:
        """Stop the loop, then withdraw every entry of this holder (the node is leaving)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            # asyncio.wait, not await: bounded, and it never raises the loop's CancelledError.
            done, _ = await asyncio.wait([self._task], timeout=STOP_TIMEOUT_S)
            if not done:
                log.warning("the index publisher of %s did not stop within %.0f s; leaving it",
                            self.holder, STOP_TIMEOUT_S)
            self._task = None
        self.store.drain_events()
        self.feed.discard_changes()
        await asyncio.wait_for(self.index.drop_holder(self.holder), INDEX_CALL_TIMEOUT_S)
