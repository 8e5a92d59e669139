"""PullGate: a kvstore serves the gets in progress before the puts.

One kvstore process carries a disaggregated burst's pages both ways on one event loop: the prefill
workers' puts in, the decode workers' gets out. A put call stores its blocks back to back (a
PutShared of 64 blocks never awaits), so a get that arrives behind a few such calls waits for all
of them, and its request, whose first token is already out, stalls before its second. Through the
gate a put call gives the loop up every `slice_blocks` blocks and waits for the gets in progress
at that moment to finish (not for those that come after), at most `max_wait_s` a slice: the
requests already admitted move first (as an engine schedules its running requests before new
prefills), and pushes, which admit new ones, are never starved. `max_wait_s` 0 turns it off:
calls take the loop in arrival order, a put call's blocks in one go.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Iterator

SLICE_BLOCKS = 8  # blocks a put stores between turns (~0.3 ms of a 103 KiB block's put on the H200 host)


class PullGate:
    def __init__(self, max_wait_s: float, slice_blocks: int = SLICE_BLOCKS) -> None:
        if max_wait_s < 0 or slice_blocks < 1:
            raise ValueError(f"PullGate needs max_wait_s >= 0 and slice_blocks >= 1, got {max_wait_s}, {slice_blocks}")
        self.max_wait_s = max_wait_s
        self.slice_blocks = slice_blocks
        self.waited_s = 0.0  # seconds put calls have waited for gets, in all
        self._pulls: set[asyncio.Future] = set()  # one a get in progress, done when it ends

    @property
    def pulls(self) -> int:
        """Gets in progress."""
        return len(self._pulls)

    @contextlib.contextmanager
    def pulling(self) -> Iterator[None]:
        """`with gate.pulling():` around a get's reads and copies (nests)."""
        done = asyncio.get_running_loop().create_future()
        self._pulls.add(done)
        try:
            yield
        finally:
            self._pulls.discard(done)
            done.set_result(None)

    async def after_block(self, stored: int) -> None:
        """A put call's turn after its `stored`-th block: every `slice_blocks` it lets gets that
        arrived start, then waits for those in progress (at most `max_wait_s`)."""
        if self.max_wait_s <= 0 or stored % self.slice_blocks:
            return
        await asyncio.sleep(0)
        if not self._pulls:
            return
        start = time.perf_counter()
        await asyncio.wait(list(self._pulls), timeout=self.max_wait_s)
        self.waited_s += time.perf_counter() - start
