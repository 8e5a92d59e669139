"""AsyncEngine: LLMEngine stepped by one background thread of the caller's process, driven from an
asyncio loop (`engine_client.py` has the request streams; `engine_process.py` runs the engine in a
process of its own instead)."""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable, Optional

from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.engine_client import EngineClient
from kvmesh.engine.engine_info import EngineInfo

_IDLE_WAIT_S = 0.05  # how long the idle thread sleeps between checks for commands


class AsyncEngine(EngineClient):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self._info = EngineInfo.of(engine)
        self._cmds: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._fail_streams("engine stopped")

    # ---- engine thread ----
    def _run(self) -> None:
        while not self._stopping:
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                cmd()
            if not self.engine.has_unfinished():
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # a failed step fails every request in flight, not the thread
                self._fail_all(e)
                continue
            if outs:
                self._loop.call_soon_threadsafe(self._deliver, outs)

    def _fail_all(self, err: Exception) -> None:
        for rid in self.engine.request_ids():
            self.engine.abort(rid)
        self._loop.call_soon_threadsafe(self._deliver_error, err)

    async def _on_thread(self, fn: Callable[[], object]) -> object:
        """Runs fn on the engine thread and returns (or raises) its result."""
        if self._thread is None:
            raise RuntimeError("AsyncEngine.start() must be awaited first")
        fut = self._loop.create_future()

        def cmd() -> None:
            try:
                res = fn()
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                self._loop.call_soon_threadsafe(_set, fut, None, e)
            else:
                self._loop.call_soon_threadsafe(_set, fut, res, None)

        self._cmds.put(cmd)
        self._wake.set()
        return await fut

    # ---- EngineClient ----
    async def call(self, method: str, *args, **kwargs) -> object:
        fn = getattr(self.engine, method)
        return await self._on_thread(lambda: fn(*args, **kwargs))

    def _post_abort(self, request_id: str) -> None:
        if self._thread is not None:
            self._cmds.put(lambda: self.engine.abort(request_id))
            self._wake.set()

    async def run(self, fn: Callable[[LLMEngine], object]) -> object:
        """Runs fn(engine) on the engine thread between steps (tests and benchmarks: it needs the
        engine in this process)."""
        return await self._on_thread(lambda: fn(self.engine))


def _set(fut: asyncio.Future, res: object, err: Optional[BaseException]) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)

