"""EngineProcess: the engine in a process of its own (`engine_core.py`), driven from the worker's
asyncio loop through the same `EngineClient` interface as the in-process `AsyncEngine`.

Why: a worker's event loop spends ~150 µs of Python a streamed token on gRPC, and an engine thread
beside it waited for that GIL a third of its time (docs/benchmarks.md, "Where the decode worker
waits"); vLLM runs its engine core apart for the same reason. Here the loop only encodes commands and
decodes one message a step.

The process is spawned (never forked: CUDA), loads the model, and answers "ready" with its
`EngineInfo` before `start()` returns. Three threads keep the loop off the pipes: a writer sends
commands (a busy engine reads them between steps, so a full pipe must not block the loop), a reader
hands each message of the command pipe to the loop, another takes KV exports off the second pipe.
A finished request's export is a `RemoteExport` whose bytes may arrive before or after its output.
Pages travel through two shared-memory segments the worker makes (`page_segments.py`) when
`shared_memory_bytes` > 0 and /dev/shm has room, else raw on the pipes. If the process dies, every
open stream and call fails with RuntimeError and `on_lost` is called.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import queue
import threading
import weakref
from typing import Callable, Optional

from kvmesh.config import EngineConfig
from kvmesh.engine.engine_client import EngineClient
from kvmesh.engine.engine_core import ExportPending, pages_of, run_engine_core
from kvmesh.engine.engine_info import EngineInfo
from kvmesh.engine.outputs import ExportedBlock, KVExport, RequestOutput
from kvmesh.engine.page_segments import WorkerPages
from kvmesh.shm_arena import SegmentRange

log = logging.getLogger(__name__)

# how long a pull waits for room in the imports segment before its pages take the command pipe
IMPORT_SPACE_WAIT_S = 2.0

POLL_S = 0.5  # how often start() checks that a loading process is still alive
STOP_TIMEOUT_S = 30.0  # a stopping process finishes its step and its exports' copies first


class RemoteExport(KVExport):
    """A finished request's KV export whose bytes come from the engine process after its output."""

    def __init__(self, pending: ExportPending) -> None:
        super().__init__([], [], pending.tail_tokens, pending.tail_dtype, None)
        self._arrived = threading.Event()
        self._error = ""
        self._release: Optional[weakref.finalize] = None

    def fill(self, blocks: list[ExportedBlock], tail: bytes, release: Optional[Callable[[], None]] = None) -> None:
        """`release`: gives the blocks' shared range back (their data are views into it)."""
        self._blocks, self._tail = blocks, tail
        if release is not None:
            self._release = weakref.finalize(self, release)  # given back at the latest when dropped
        self._arrived.set()

    def release(self) -> None:
        """The pages have been read (pushed): their shared range may be reused. Once; harmless again."""
        if self._release is not None:
            self._release()

    def fail(self, why: str) -> None:
        self._error = why
        self._arrived.set()

    def ready(self) -> "RemoteExport":
        """Waits for the bytes (call it from a worker thread, as for any KVExport)."""
        self._arrived.wait()
        if self._error:
            raise RuntimeError(f"KV export failed in the engine process: {self._error}")
        return self


def _settle(export: RemoteExport, msg: tuple) -> None:
    """Fills (or fails) an export from its "export" (or "export_failed") message."""
    if msg[0] == "export":
        export.fill(*msg[2:])
    else:
        export.fail(msg[2])


def _raise_as(err: tuple[bool, str]) -> Exception:
    is_value, text = err
    return ValueError(text) if is_value else RuntimeError(text)


class EngineProcess(EngineClient):
    def __init__(self, config: EngineConfig, shared_memory_bytes: int = 0) -> None:
        super().__init__()
        self.config = config
        self.shared_memory_bytes = shared_memory_bytes  # both page segments together (0: the pipes only)
        self._pages: Optional[WorkerPages] = None
        self._info: Optional[EngineInfo] = None
        self._proc: Optional[multiprocessing.process.BaseProcess] = None
        self._conn = None  # commands out, results and outputs in (read on the loop)
        self._export_conn = None  # exports in (read by a thread)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # for the writer thread; None: stop
        self._threads: list[threading.Thread] = []
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._prompts: dict[str, list[int]] = {}  # outputs come without them
        self._exports: dict[str, RemoteExport] = {}  # announced, bytes not yet here
        self._early: dict[str, tuple] = {}  # bytes here, output not yet: ("export"|"export_failed", ...)
        self._lost = ""  # why the process is gone ("" while it serves)
        self._stopping = False

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("EngineProcess.start() must be awaited first")
        return self._info

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    # ---- lifecycle ----
    async def start(self) -> None:
        """Spawns the process and returns once its engine is loaded (RuntimeError if it cannot be)."""
        if self._proc is not None:
            return
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe(duplex=True)
        exports_in, exports_out = ctx.Pipe(duplex=False)
        if self.shared_memory_bytes > 0 and self._pages is None:
            self._pages = WorkerPages.create(self.shared_memory_bytes)
        names = self._pages.names if self._pages is not None else None
        proc = ctx.Process(target=run_engine_core, args=(self.config, theirs, exports_out, names),
                           name="kvmesh-engine-core", daemon=True)
        proc.start()
        theirs.close()
        exports_out.close()
        self._proc, self._conn, self._export_conn = proc, mine, exports_in
        kind, payload, *mapped = await asyncio.to_thread(self._first_message)
        if kind != "ready":
            await asyncio.to_thread(self._reap)
            self._proc = None
            self._close_pages()
            raise RuntimeError(f"the engine process could not start: {payload}")
        if not (mapped and mapped[0]):  # the engine could not map them: the pipes carry every page
            self._close_pages()
        self._info = payload
        self._lost, self._stopping = "", False
        self._threads = [threading.Thread(target=self._read, name="kvmesh-engine-reader", daemon=True),
                         threading.Thread(target=self._read_exports, name="kvmesh-engine-exports", daemon=True),
                         threading.Thread(target=self._write, name="kvmesh-engine-writer", daemon=True)]
        for t in self._threads:
            t.start()

    def _first_message(self) -> tuple:
        while not self._conn.poll(POLL_S):
            if not self._proc.is_alive():
                return "failed", f"it exited with code {self._proc.exitcode}"
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return "failed", f"it exited with code {self._proc.exitcode}"

    async def stop(self) -> None:
        if self._proc is None:
            return
        self._stopping = True
        self._outbox.put(("stop",))
        self._outbox.put(None)
        await asyncio.to_thread(self._reap)
        for t in self._threads:
            await asyncio.to_thread(t.join, STOP_TIMEOUT_S)
        self._proc = None
        self._on_lost("engine stopped")
        self._close_pages()

    def _close_pages(self) -> None:
        if self._pages is not None:
            self._pages.close()
            self._pages = None

    def _reap(self) -> None:
        self._proc.join(STOP_TIMEOUT_S)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        self._export_conn.close()

    # ---- pipe threads ----
    def _write(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                if msg[0] == "import":  # the header, then the pages back to back, raw
                    self._conn.send(msg[:-1])
                    self._conn.send_bytes(b"".join(msg[-1]))
                elif msg[0] == "import_shared":  # the pages into the range taken for them, then the header
                    _, cid, hashes, token_ids, salt, offset, nbytes, pages = msg
                    if pages is not None:  # None: a kvstore get wrote them there
                        WorkerPages.fill(self._pages.imports.view(offset, nbytes), pages)
                    self._conn.send(msg[:-1])
                else:
                    self._conn.send(msg)
            except (OSError, ValueError):  # the process is gone: the reader reports it
                return

    def _read(self) -> None:
        """Every message the engine sends on the command pipe, handed to the loop. (Not read on the
        loop with add_reader: libuv, under the workers' uvloop, makes the socket non-blocking, and
        the writer thread's sends then fail with EAGAIN once the pipe fills.)"""
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "export_shared":  # the pages are in the exports segment: views into it, cut here
                msg = self._shared_export(msg)
            self._to_loop(self._on_message, msg)
        code = self._proc.exitcode if self._proc is not None else None
        self._to_loop(self._on_lost, f"the engine process exited (code {code})")

    def _read_exports(self) -> None:
        while True:
            try:
                msg = self._export_conn.recv()
                if msg[0] == "export":  # the pages follow, raw; cut here, off the loop
                    _, rid, hashes, token_ids, tail = msg
                    msg = ("export", rid, pages_of(hashes, token_ids, self._export_conn.recv_bytes(), own=True), tail)
            except (EOFError, OSError):
                return  # the command pipe reports the end
            self._to_loop(self._on_message, msg)

    def _shared_export(self, msg: tuple) -> tuple:
        """("export_shared", ...) as ("export", request id, blocks viewing the segment, tail, release)."""
        _, rid, hashes, token_ids, offset, pages_bytes, tail_bytes = msg
        blocks = pages_of(hashes, token_ids, self._pages.export_view(offset, pages_bytes))
        tail = bytes(self._pages.export_view(offset + pages_bytes, tail_bytes))
        name, size = self._pages.exports.name, pages_bytes // max(1, len(blocks))
        for i, b in enumerate(blocks):  # a push to a kvstore on this host names them, no copy
            b.shared = (name, offset + i * size)
        return "export", rid, blocks, tail, functools.partial(self._release, offset, pages_bytes + tail_bytes)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    # ---- on the loop ----
    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "outputs":
            self._deliver(self._restored(msg[1]))
        elif kind == "result":
            _, cid, ok, value = msg
            fut = self._calls.pop(cid, None)
            if fut is not None and not fut.done():
                fut.set_result(value) if ok else fut.set_exception(_raise_as(value))
        elif kind == "imported":  # the engine's copy out of the call's imports range has landed
            if self._pages is not None:
                self._pages.landed(msg[1])
        elif kind in ("export", "export_failed"):
            export = self._exports.pop(msg[1], None)
            if export is None:  # before the output that announces it
                self._early[msg[1]] = msg
            else:
                _settle(export, msg)
        elif kind == "step_failed":
            self._deliver_error(_raise_as(msg[1]))

    def _restored(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        for o in outs:
            o.prompt_token_ids = self._prompts.get(o.request_id, [])
            if isinstance(o.kv_export, ExportPending):
                o.kv_export = RemoteExport(o.kv_export)
                early = self._early.pop(o.request_id, None)
                if early is None:
                    self._exports[o.request_id] = o.kv_export
                else:
                    _settle(o.kv_export, early)
        return outs

    def _on_lost(self, why: str) -> None:
        if self._lost:
            return
        self._lost = "engine stopped" if self._stopping else why
        if not self._stopping:
            log.error("%s; failing its %d streams", why, len(self._queues))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(RuntimeError(self._lost))
        self._calls.clear()
        if self._pages is not None:
            self._pages.give_back_held()  # and wakes the waiters for room, which see the engine gone
        for export in self._exports.values():
            export.fail(self._lost)
        self._exports.clear()
        self._early.clear()
        self._fail_streams(self._lost)
        if not self._stopping and self.on_lost is not None:
            self.on_lost(why)

    # ---- EngineClient ----
    async def call(self, method: str, *args, **kwargs) -> object:
        return await self._ask("call", method, args, kwargs)

    async def import_blocks(self, blocks: list[ExportedBlock], cache_salt: str = "",
                            reserved: Optional[SegmentRange] = None) -> int:
        """As `EngineClient.import_blocks`. Pages that a kvstore get wrote into `reserved` back to back
        (each block's `shared` names the spot) go as that range, not copied; others are copied into a
        range of the imports segment, or cross the pipe raw, not pickled (joined by the writer
        thread, which must not meet a page it cannot join)."""
        for b in blocks:
            if not isinstance(b.data, (bytes, bytearray, memoryview)):
                self.release_import(reserved)
                raise ValueError(f"blocks[].data must be bytes, got {type(b.data).__name__}")
        head = ([b.hash for b in blocks], [b.token_ids for b in blocks], cache_salt)
        nbytes = sum(len(b.data) for b in blocks)
        if reserved is not None and blocks and WorkerPages.in_place(blocks, reserved) and not self._lost:
            self._imported("in_place")
            return await self._ask("import_shared", *head, reserved.offset, nbytes, None,
                                   holds=(reserved.offset, reserved.nbytes))
        self.release_import(reserved)
        offset = self._pages.imports.alloc(nbytes) if self._pages is not None and blocks and not self._lost else None
        if offset is None:
            self._imported("pipe")
            return await self._ask("import", *head, [b.data for b in blocks])
        self._imported("shared_memory")
        return await self._ask("import_shared", *head, offset, nbytes, [b.data for b in blocks],
                               holds=(offset, nbytes))

    async def reserve_import(self, nbytes: int) -> Optional[SegmentRange]:
        """Waits up to IMPORT_SPACE_WAIT_S for the room (imports land and give theirs back within
        a step or so): an import that finds none takes the command pipe, and the engine's main
        thread then stages its pages between steps, which every running stream waits for."""
        pages = self._pages
        if pages is None or self._lost:
            return None
        reserved = await pages.reserve(nbytes, IMPORT_SPACE_WAIT_S)
        if reserved is not None and self._lost:  # the engine went while this waited
            pages.give_back(reserved.offset, reserved.nbytes)
            return None
        return reserved

    def release_import(self, reserved: Optional[SegmentRange]) -> None:
        if reserved is not None and self._pages is not None:
            self._pages.give_back(reserved.offset, reserved.nbytes)

    async def _ask(self, kind: str, *parts, holds: Optional[tuple[int, int]] = None) -> object:
        """Sends (kind, id, *parts) and waits for the engine's result of it. `holds`: an imports
        range the call's pages fill, given back when the engine says its copy out of it has landed
        (not when the result comes, nor when a waiter leaves)."""
        if self._lost:
            raise RuntimeError(self._lost)
        if self._info is None:
            raise RuntimeError("EngineProcess.start() must be awaited first")
        cid = next(self._ids)
        fut = self._loop.create_future()
        self._calls[cid] = fut
        if holds is not None:
            self._pages.hold(cid, *holds)
        self._outbox.put((kind, cid, *parts))
        return await fut

    def _release(self, offset: int, nbytes: int) -> None:
        """An exports range read: the engine may reuse it (from any thread; a gone engine ignores it)."""
        if not self._lost:
            self._outbox.put(("release", offset, nbytes))

    def _post_abort(self, request_id: str) -> None:
        if not self._lost and self._info is not None:
            self._outbox.put(("abort", request_id))

    def _added(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._prompts[request_id] = list(prompt_token_ids)

    def _removed(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
