"""IndexPublisher: stop() returns even when the index swallows the cancel (a CI hang), flush, withdraw."""
from __future__ import annotations

import asyncio
import os

from kvmesh.index import MemoryIndex
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.publisher import IndexPublisher
from kvmesh.kvstore.store import BlockStore

from cancel_swallowing_index import CancelSwallowingIndex


class StopsMidPublishIndex(MemoryIndex):
    """publish() starts the publisher's stop() and returns in the same loop step as its cancel lands:
    the race inside asyncio.wait_for itself (Python 3.11 then returns instead of raising)."""

    def __init__(self) -> None:
        super().__init__()
        self.publisher: IndexPublisher | None = None
        self.stop_task: asyncio.Task | None = None

    async def publish(self, holder: str, stored: list[bytes], removed: list[bytes]) -> None:
        if self.stop_task is None:
            self.stop_task = asyncio.create_task(self.publisher.stop())
            await asyncio.sleep(0)  # stop() runs and cancels; this call then completes before the wakeup
        await super().publish(holder, stored, removed)


def store_with_one_block() -> tuple[BlockStore, bytes]:
    store = BlockStore(KVStoreConfig(capacity_blocks=2, block_bytes=4096, device="cpu"))
    h = os.urandom(32)
    store.put(h, os.urandom(4096), [1, 2, 3], "L1")
    return store, h


async def test_stop_returns_although_the_index_swallowed_the_cancel():
    store, h = store_with_one_block()
    index = CancelSwallowingIndex()
    publisher = IndexPublisher(store, index, "kv-0:1", interval=0.01)
    publisher.start()
    await asyncio.wait_for(index.in_publish.wait(), 5)
    # asyncio.wait, not wait_for: on 3.11 a wait_for that times out as its call ends returns normally
    stop = asyncio.create_task(publisher.stop())
    done, _ = await asyncio.wait([stop], timeout=5)
    if not done:  # the old publisher: its loop went on after the swallowed cancel and stop() hung
        stop.cancel()
        await asyncio.wait([stop])
    assert done, "IndexPublisher.stop() hung after the index swallowed its cancel"
    stop.result()
    assert index.swallowed == 1
    assert await index.lookup([h]) == [frozenset()]  # withdrawn on the way out


async def test_stop_returns_when_the_cancel_lands_as_the_index_call_completes():
    store, h = store_with_one_block()
    index = StopsMidPublishIndex()
    publisher = IndexPublisher(store, index, "kv-0:1", interval=0.01)
    index.publisher = publisher
    publisher.start()
    for _ in range(500):
        if index.stop_task is not None:
            break
        await asyncio.sleep(0.01)
    done, _ = await asyncio.wait([index.stop_task], timeout=5)
    assert done, "IndexPublisher.stop() hung after its cancel was swallowed"
    index.stop_task.result()
    assert await index.lookup([h]) == [frozenset()]


async def test_flush_publishes_and_stop_withdraws():
    store, h = store_with_one_block()
    index = MemoryIndex()
    publisher = IndexPublisher(store, index, "kv-0:1", interval=30.0)
    publisher.start()
    await publisher.flush()
    assert await index.lookup([h]) == [frozenset({"kv-0:1"})]
    await publisher.stop()
    assert await index.lookup([h]) == [frozenset()]
