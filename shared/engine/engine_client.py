"""EngineClient: how a worker's event loop drives an engine that steps elsewhere, in a thread of its
process (`AsyncEngine`) or in a process of its own (`EngineProcess`).

Every engine call is a command executed between steps (`call`), so the engine itself stays
single-threaded. Outputs reach per-request collectors on the loop, merged while their reader lags
(`output_collector.py`). Closing or cancelling a request's iterator aborts it (its blocks are freed
before the next step).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Optional

from kvmesh.engine.engine_info import EngineInfo
from kvmesh.engine.output_collector import OutputCollector
from kvmesh.engine.outputs import ExportedBlock, OutputKind, RequestOutput, ResumeState
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.shm_arena import SegmentRange


class EngineClient:
    """Subclasses run the engine and implement `start`, `stop`, `call`, `_post_abort` and `info`;
    they hand each step's outputs to `_deliver` and a step's failure to `_deliver_error`, on the loop."""

    def __init__(self) -> None:
        self._queues: dict[str, OutputCollector] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.on_lost: Optional[Callable[[str], None]] = None
        """Called on the loop, with why, if the engine dies on its own (an engine process can)."""
        self.on_import: Optional[Callable[[str], None]] = None
        """Called with the way each import's pages reach the engine: in_place (a kvstore get wrote
        them where the engine reads), shared_memory (copied there), pipe, or in_process."""

    # ---- what a subclass provides ----
    @property
    def info(self) -> EngineInfo:
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def call(self, method: str, *args, **kwargs) -> object:
        """Runs `LLMEngine.<method>(*args, **kwargs)` between steps and returns (or raises) its result."""
        raise NotImplementedError

    def _post_abort(self, request_id: str) -> None:
        """Aborts a request between steps without waiting (nothing if the engine has stopped)."""
        raise NotImplementedError

    def _added(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """A request is about to be added (EngineProcess keeps its prompt)."""

    def _removed(self, request_id: str) -> None:
        """A request's stream has ended."""

    # ---- outputs, on the loop ----
    def _deliver(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put(o)

    def _deliver_error(self, err: Exception) -> None:
        for q in self._queues.values():
            q.put(err)

    def _fail_streams(self, why: str) -> None:
        """Ends every open stream with RuntimeError(why) (the engine is gone)."""
        for q in self._queues.values():
            q.put(RuntimeError(why))
        self._queues.clear()

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
        self._added(request_id, prompt_token_ids)
        finished = False
        try:
            try:
                await self.call("add_request", request_id, prompt_token_ids, params, cache_salt=cache_salt,
                                export_kv=export_kv, hand_off=hand_off, resume=resume, output_kind=output_kind)
            except Exception:
                finished = True  # refused (bad prompt or params, engine gone): never added
                raise
            # From here on, or once the call above was sent: a caller that leaves must abort the
            # request. (Cancelled while waiting for the engine's answer, it has been added all the same.)
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
            self._removed(request_id)
            if not finished:
                self._post_abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its blocks are freed at once); its stream ends without a final item."""
        await self.call("abort", request_id)
        q = self._queues.get(request_id)
        if q is not None:
            q.put(None)

    async def import_blocks(self, blocks: list[ExportedBlock], cache_salt: str = "",
                            reserved: Optional[SegmentRange] = None) -> int:
        """Puts pages computed elsewhere into the engine's prefix cache; returns how many it took.
        `reserved`: a range `reserve_import` gave, which the call takes over (whatever happens)."""
        self.release_import(reserved)
        self._imported("in_process")
        return await self.call("import_blocks", blocks, cache_salt)

    def _imported(self, path: str) -> None:
        if self.on_import is not None:
            self.on_import(path)

    async def reserve_import(self, nbytes: int) -> Optional[SegmentRange]:
        """A range of shared memory the engine copies imports straight out of, for a kvstore get to
        fill (`import_blocks(..., reserved=)` then takes the pages that lie in it without a copy), or
        None: this engine has no such memory, or none came free in time."""
        return None

    def release_import(self, reserved: Optional[SegmentRange]) -> None:
        """Gives back a `reserve_import` range that no import took (None: nothing)."""
