"""AsyncEngine: LLMEngine stepped by one background thread, driven from an asyncio loop.

Every engine call (add, abort, import) is a command executed on the engine thread between steps, so
the engine itself stays single-threaded. Outputs go back to per-request collectors with
`call_soon_threadsafe`, merged while their reader lags (`output_collector.py`). Closing or
cancelling a request's iterator aborts it (its blocks are freed before the next step).
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator, Callable, Optional

from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.output_collector import OutputCollector
from kvmesh.engine.outputs import ExportedBlock, OutputKind, RequestOutput, ResumeState
from kvmesh.engine.sampling_params import SamplingParams

_IDLE_WAIT_S = 0.05  # how long the idle thread sleeps between checks for commands


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, OutputCollector] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

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
        for q in self._queues.values():
            q.put(RuntimeError("engine stopped"))
        self._queues.clear()

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

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put(o)

    def _deliver_error(self, err: Exception) -> None:
        for q in self._queues.values():
            q.put(err)

    async def _call(self, fn: Callable[[], object]) -> object:
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

    # ---- public ----
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       cache_salt: str = "", export_kv: bool = False, hand_off: bool = False,
                       resume: Optional[ResumeState] = None,
                       output_kind: OutputKind = OutputKind.CUMULATIVE,
                       pace: Optional[Callable[[], float]] = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine steps. `pace`: seconds the next output waits after
        one is yielded (what the steps add meanwhile merges into it; the last output never waits)."""
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        q = OutputCollector(output_kind)
        self._queues[request_id] = q
        finished = added = False
        try:
            await self._call(lambda: self.engine.add_request(
                request_id, prompt_token_ids, params, cache_salt=cache_salt, export_kv=export_kv,
                hand_off=hand_off, resume=resume, output_kind=output_kind))
            added = True
            hold_until = 0.0
            while not finished:
                item = await q.get(hold_until)
                if item is None:  # aborted through abort(): the stream just ends
                    finished = True
                    break
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if pace is not None:
                    hold_until = self._loop.time() + pace()
        finally:
            self._queues.pop(request_id, None)
            if added and not finished and self._thread is not None:
                self._cmds.put(lambda: self.engine.abort(request_id))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its blocks are freed at once); its stream ends without a final item."""
        await self._call(lambda: self.engine.abort(request_id))
        q = self._queues.get(request_id)
        if q is not None:
            q.put(None)

    async def import_blocks(self, blocks: list[ExportedBlock], cache_salt: str = "") -> int:
        return await self._call(lambda: self.engine.import_blocks(blocks, cache_salt))

    async def run(self, fn: Callable[[LLMEngine], object]) -> object:
        """Runs fn(engine) on the engine thread between steps (for stats, events, lookups)."""
        return await self._call(lambda: fn(self.engine))


def _set(fut: asyncio.Future, res: object, err: Optional[BaseException]) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)
