"""LoopWatch: a service's log says when its event loop is held. One blocking call on the loop stops
every call, health check and stream of the process at once, and nothing else shows it: the kvstore's
first put once touched its 1 GiB slab there for 3-4 s (docs/kvstore.md, "Memory").

A task on the loop beats every `beat_s`; a thread checks the beat. Once the loop has not beaten for
`threshold_s` while it runs Python code (not while it waits in its poll, nor while the process is
starved of CPU between callbacks), the thread logs the stack the loop thread is in, once a stall;
when the loop beats again it logs how long it was held.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Optional

# innermost frames of a loop that waits in its poll (uvloop's run_until_complete is native code)
_IDLE_FILES = ("asyncio/runners.py", "uvloop/__init__.py", "selectors.py")

log = logging.getLogger("kvmesh.loop")


def runs_code(frame: Optional[FrameType]) -> bool:
    """Whether the loop thread, at `frame`, is inside a callback rather than waiting in its poll."""
    return frame is not None and not frame.f_code.co_filename.endswith(_IDLE_FILES)


class LoopWatch:
    def __init__(self, threshold_s: float = 1.0, beat_s: float = 0.1) -> None:
        self.threshold_s = threshold_s
        self.beat_s = beat_s
        self.stalls = 0  # stalls reported (tests read it)
        self._last = time.monotonic()
        self._reported_at: Optional[float] = None  # the beat the current stall's report saw
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._task: Optional[asyncio.Task] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """On the loop's thread, inside the loop."""
        self._loop_thread = threading.get_ident()
        self._last = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._beat(), name="kvmesh-loop-watch")
        self._thread = threading.Thread(target=self._watch, name="kvmesh-loop-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def _beat(self) -> None:
        while True:
            now = time.monotonic()
            if self._reported_at is not None and self._reported_at == self._last:
                log.warning("the event loop was held %.2f s", now - self._last)
                self._reported_at = None
            self._last = now
            await asyncio.sleep(self.beat_s)

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_s):
            last = self._last
            held = time.monotonic() - last
            if held < self.threshold_s or self._reported_at == last:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if not runs_code(frame):
                continue
            self._reported_at = last
            self.stalls += 1
            stack = "".join(traceback.format_stack(frame))
            log.warning("the event loop has been held %.2f s, so far, by a blocking call; it is in:\n%s",
                        held, stack.rstrip())
