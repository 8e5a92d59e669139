"""IndexPublisher: batches the store's stored/removed events into the prefix index.

Best effort: the store is the source of truth, so a failed publish is retried with the next batch and
a lost one only costs a reader a miss.
"""
from __future__ import annotations

import asyncio
import logging

from kvmesh.index import PrefixIndex
from kvmesh.kvstore.store import BlockStore

log = logging.getLogger(__name__)


class IndexPublisher:
    def __init__(self, store: BlockStore, index: PrefixIndex, holder: str, interval: float) -> None:
        self.store = store
        self.index = index
        self.holder = holder
        self.interval = interval
        self._pending: dict[bytes, bool] = {}  # failed batches wait here, merged with newer events
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # an explicit flush waits for a batch already in flight

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"index-publisher-{self.holder}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.flush()
            except Exception as exc:  # the index is advisory: keep serving, retry next tick
                log.warning("publishing to the prefix index failed (%s); retrying", exc)

    async def flush(self) -> None:
        """Publish everything the store reported since the last flush (and wait for it)."""
        async with self._lock:
            await self._flush_locked()

    async def _flush_locked(self) -> None:
        stored, removed = self.store.drain_events()
        for h in stored:
            self._pending.pop(h, None)
            self._pending[h] = True
        for h in removed:
            self._pending.pop(h, None)
            self._pending[h] = False
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        try:
            await self.index.publish(self.holder, [h for h, s in batch.items() if s],
                                     [h for h, s in batch.items() if not s])
        except BaseException:
            batch.update(self._pending)  # newer events win
            self._pending = batch
            raise

    async def stop(self) -> None:
        """Stop the loop, then withdraw every entry of this holder (the node is leaving)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._pending.clear()
        self.store.drain_events()
        await self.index.drop_holder(self.holder)
