"""One request's outputs between the engine thread and the coroutine streaming them, merged while
that coroutine lags.

The engine steps every few milliseconds; a worker's event loop serving hundreds of streams may take
longer than a step to send one message to each. Queued one output a step, every stream's backlog and
the loop's work a token would grow together. Merged, a stream that is behind takes everything since
its last read as one output: one gRPC message, one SSE event at the gateway, however many steps it
spans. The lag a reader can build is then a step's worth of the loop's time, and a busy loop sends
fewer, larger messages instead of falling further behind (vLLM's API server merges the same way).
A reader may also hold an output back on purpose (`get(hold_until)`), to pace its messages.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Optional, Union

from kvmesh.engine.outputs import OutputKind, RequestOutput, merge_delta

Item = Union[RequestOutput, Exception, None]
"""An output; an exception that ends the stream (raised to the reader); None: aborted, the stream ends."""


class OutputCollector:
    """Items for one reader, on the event loop's thread only."""

    def __init__(self, kind: OutputKind) -> None:
        self._kind = kind
        self._items: collections.deque[Item] = collections.deque()
        self._ready = asyncio.Event()
        self._holding = False  # a reader waits for its deadline: only an ending item wakes it early

    def put(self, item: Item) -> None:
        tail: Optional[Item] = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(tail, RequestOutput) \
                and item.error is None and tail.error is None:
            # DELTA: both steps' news in one; otherwise the newest output holds everything so far.
            self._items[-1] = merge_delta(tail, item) if self._kind is OutputKind.DELTA else item
        else:
            self._items.append(item)
        if not self._holding or _ends(item):
            self._ready.set()

    async def get(self, hold_until: float = 0.0) -> Item:
        """The next item. With `hold_until` (event-loop time) an output that arrives earlier waits
        there, taking in what the next steps add, unless the stream ends first (its last output, an
        error or an abort is handed over at once)."""
        loop = asyncio.get_running_loop()
        while not self._items or (loop.time() < hold_until and not any(map(_ends, self._items))):
            self._ready.clear()
            self._holding = bool(self._items)
            timer = loop.call_at(hold_until, self._ready.set) if self._holding else None
            try:
                await self._ready.wait()
            finally:
                self._holding = False
                if timer is not None:
                    timer.cancel()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


def _ends(item: Item) -> bool:
    """Whether an item ends the stream or must reach the reader as it is (never held back)."""
    return not isinstance(item, RequestOutput) or item.finished or item.error is not None
