"""A real memory index with one injected fault: its first publish() completes normally when
cancelled, as a redis-py 8 call does on Python 3.11 when the cancel lands just as its
asyncio.wait_for finishes (CPython gh-86296). Publish loops must still end, on their stop flag."""
from __future__ import annotations

import asyncio

from kvmesh.index import MemoryIndex


class CancelSwallowingIndex(MemoryIndex):
    def __init__(self) -> None:
        super().__init__()
        self.in_publish = asyncio.Event()  # set once the first publish() is waiting for the cancel
        self.swallowed = 0

    async def publish(self, holder: str, stored: list[bytes], removed: list[bytes]) -> None:
        if not self.in_publish.is_set():  # the first call waits for the cancel (drop_holder also publishes)
            self.in_publish.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.swallowed += 1
        await super().publish(holder, stored, removed)
