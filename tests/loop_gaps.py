"""LoopGaps: the gaps between an event loop's turns while a block runs (a ticker task on the loop),
for tests that check that some work leaves the loop free."""
from __future__ import annotations

import asyncio


class LoopGaps:
    def __init__(self, tick_s: float = 0.01) -> None:
        self.tick_s = tick_s
        self.gaps: list[float] = []
        self.seconds = 0.0  # how long the block ran
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tick_s)
            self.gaps.append(loop.time() - self._last)
            self._last = loop.time()

    @property
    def longest(self) -> float:
        return max(self.gaps, default=0.0)

    async def __aenter__(self) -> "LoopGaps":
        self._last = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(2 * self.tick_s)
        self._started = asyncio.get_running_loop().time()
        return self

    async def __aexit__(self, *exc) -> None:
        now = asyncio.get_running_loop().time()
        self.seconds = now - self._started
        self.gaps.append(now - self._last)  # a stall the block ended with, before the ticker's turn
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
