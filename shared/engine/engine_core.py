"""EngineCore: the engine in a process of its own (`EngineProcess` spawns it), so that its steps
never wait for the GIL of the worker's event loop, which speaks gRPC to every stream.

Two pipes to the worker. On the first, the main thread does everything, between steps: it reads the
commands waiting (`poll(0)`), runs them, steps once and sends the step's outputs as one message. No
helper thread takes part, because a thread that wakes for every message waits for the GIL each time
(up to the 5 ms switch interval while the step loop runs Python): with a reader and a sender thread
a served step took 9.7 ms (TPOT p50) where it now takes 4.0, and a resumed request's import waited
seconds (docs/benchmarks.md, "Thirty-second session"). On the second pipe an exporter thread waits for each finished
request's KV pages to land in host memory and sends them raw, so the step loop never writes
megabytes. Where the worker made page segments (`page_segments.py`), a request's pages land
straight in a range of the exports segment instead, and this thread announces the range on the
first pipe once they have landed; the exporter thread then carries only what found no room.

Pipe 1, worker -> core: ("call", id, method, args, kwargs); ("import", id, hashes, token ids, cache
salt) and right after it every page back to back as one raw message (an `import_blocks` call), or
("import_shared", id, hashes, token ids, cache salt, offset, nbytes) with the pages in the imports
segment, which stays the worker's until ("imported", id) says the copy out of it has landed;
("release", offset, nbytes) gives an exports range back; ("abort", request_id); ("stop",).
Core -> worker: ("ready", EngineInfo, whether it mapped the page segments) | ("failed", why) first;
then ("result", id, ok, value), ("imported", id) (an "import_shared"'s range is free again),
("outputs", [RequestOutput]) (prompt ids left out: the worker has
them; a KV export as `ExportPending`), ("step_failed", error), ("export_shared", request_id,
hashes, token ids, offset, pages' bytes, tail's bytes) with the pages and then the tail in the
exports segment (after the output that announces the export) or ("export_failed", request_id, why).
Pipe 2, core -> worker: ("export", request_id, hashes, token ids, tail) and right after it the pages
back to back as one raw message (written from the pinned copy: no pickling, no bytes object a page),
or ("export_failed", request_id, why). An export may arrive before or after the output announcing it.
"""
from __future__ import annotations

import collections
import logging
import queue
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Optional

from kvmesh.config import EngineConfig
from kvmesh.engine.engine_info import EngineInfo
from kvmesh.engine.outputs import ExportedBlock, KVExport
from kvmesh.engine.page_segments import CorePages, SegmentNames
from kvmesh.stack_dump import install_threads_only

if TYPE_CHECKING:
    from kvmesh.engine.engine import LLMEngine

log = logging.getLogger(__name__)

# what the worker may ask of the engine between steps
CALLS = frozenset({"add_request", "abort", "import_blocks", "drain_kv_events", "stats", "has_unfinished",
                   "request_ids"})


@dataclass(frozen=True)
class ExportPending:
    """Stands for a finished request's KVExport in its output; the bytes come on the export pipe."""

    tail_tokens: int
    tail_dtype: str


def error_of(exc: BaseException) -> tuple[bool, str]:
    """An exception as (is a ValueError, message): what crosses the pipe (exceptions need not pickle)."""
    text = str(exc) if isinstance(exc, (ValueError, RuntimeError)) else f"{type(exc).__name__}: {exc}"
    return isinstance(exc, ValueError), text


def pages_of(hashes: list[bytes], token_ids: list[list[int]], pages: bytes, own: bool = False) -> list[ExportedBlock]:
    """Blocks over one buffer of pages back to back: views into it (an import, used before the
    buffer goes), or (own) a bytes object each (an export's blocks, as `KVExport.blocks` gives them)."""
    size = len(pages) // max(1, len(hashes))
    src = pages if own else memoryview(pages)  # slicing bytes copies, slicing a view does not
    return [ExportedBlock(h, t, src[i * size:(i + 1) * size]) for i, (h, t) in enumerate(zip(hashes, token_ids))]


def run_engine_core(config: EngineConfig, conn: Connection, export_conn: Connection,
                    segments: Optional[SegmentNames] = None) -> None:
    """The engine process's entry point: builds the engine, says so, serves until told to stop or
    the worker's end of the pipe closes. `segments`: the worker's page segments, if it made them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker, which stops this process
    install_threads_only()  # kill -USR1: this process's thread stacks on stderr
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from kvmesh.engine.engine import LLMEngine  # here, not at import: the worker's side needs no torch
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - reported to the worker, which raises it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    pages = None
    if segments is not None:
        try:
            pages = CorePages(segments, engine.runner.device.type)  # resolved: --device auto may be cuda
        except Exception:  # noqa: BLE001 - the pipes carry every page then (the worker is told)
            log.exception("could not map the worker's page segments; pages take the pipes")
    conn.send(("ready", EngineInfo.of(engine), pages is not None))
    try:
        EngineCore(engine, conn, export_conn, pages).run()
    finally:
        if pages is not None:
            pages.close()


class EngineCore:
    def __init__(self, engine: LLMEngine, conn: Connection, export_conn: Connection,
                 pages: Optional[CorePages] = None) -> None:
        self.engine = engine
        self.conn = conn
        self.export_conn = export_conn
        self.pages = pages
        self.exports: queue.SimpleQueue = queue.SimpleQueue()  # (request id, KVExport); None: stop
        # exports landing in the exports segment, in step order: announced by this thread once landed
        self.landing: collections.deque[tuple[str, KVExport]] = collections.deque()
        if pages is not None and pages.takes_exports:
            engine.export_space = pages
        self.gone = False  # the worker's end closed

    def run(self) -> None:
        exporter = threading.Thread(target=self._export, name="kvmesh-core-exporter", daemon=True)
        exporter.start()
        try:
            self._serve()
        finally:
            self.exports.put(None)
            exporter.join()
            self.conn.close()
            self.export_conn.close()

    def _serve(self) -> None:
        while not self.gone:
            if not self.engine.has_unfinished():
                self._announce_landed(wait=True)
                self.conn.poll(None)  # idle: sleep until a command comes (or the pipe closes)
            while self.conn.poll(0):
                try:
                    msg = self.conn.recv()
                    if msg[0] == "import":  # the pages follow, raw, as one message
                        msg = msg + (self.conn.recv_bytes(),)
                except (EOFError, OSError):  # the worker is gone
                    return
                if msg[0] == "stop":
                    return
                if msg[0] == "release":
                    self.pages.release_export(msg[1], msg[2])
                    continue
                self._handle(msg)
            if self.engine.has_unfinished():
                self._step()
            self._announce_landed(wait=False)

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):  # the worker is gone
            self.gone = True

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "abort":
            self.engine.abort(msg[1])
            return
        if msg[0] == "import":
            _, cid, hashes, token_ids, salt, pages = msg
            msg = ("call", cid, "import_blocks", (pages_of(hashes, token_ids, pages), salt), {})
        elif msg[0] == "import_shared":  # the pages are copied straight out of the segment, queued
            _, cid, hashes, token_ids, salt, offset, nbytes = msg
            pages = self.pages.imports.view(offset, nbytes)
            rows = self.pages.import_rows(offset, nbytes, len(hashes))
            msg = ("call", cid, "import_blocks", (pages_of(hashes, token_ids, pages), salt), {"rows": rows})
            try:
                self._call(msg)
            finally:  # the range goes back to the worker once the stream has passed the copy
                self.pages.mark_import(cid)
            return
        self._call(msg)

    def _call(self, msg: tuple) -> None:
        _, cid, method, args, kwargs = msg
        try:
            if method not in CALLS:
                raise ValueError(f"the engine process has no call {method!r}")
            res = getattr(self.engine, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the caller's error, raised in the worker
            self._send(("result", cid, False, error_of(e)))
        else:
            self._send(("result", cid, True, res))

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # a failed step fails every request in flight, not the process
            log.exception("engine step failed")
            for rid in self.engine.request_ids():
                self.engine.abort(rid)
            self._send(("step_failed", error_of(e)))
            return
        if not outs:
            return
        for o in outs:
            o.prompt_token_ids = []  # the worker has them; sent every step they would cost the most
            if o.kv_export is not None:
                if o.kv_export.shared_range is not None:
                    self.landing.append((o.request_id, o.kv_export))
                else:
                    self.exports.put((o.request_id, o.kv_export))
                o.kv_export = ExportPending(o.kv_export.tail_tokens, o.kv_export.tail_dtype)
        self._send(("outputs", outs))

    def _announce_landed(self, wait: bool) -> None:
        """Tells the worker of each export whose pages have landed in the exports segment and of
        each import whose pages have left the imports segment (all of them, waiting, when `wait`):
        small messages from this thread, no helper thread to wake (each wake waits for this
        thread's GIL)."""
        if self.pages is not None:
            for cid in self.pages.landed_imports(wait):
                self._send(("imported", cid))
        while self.landing and (wait or self.landing[0][1].landed()):
            rid, export = self.landing.popleft()
            offset, pages_bytes, tail_bytes = export.shared_range
            try:
                hashes, token_ids = export.wait_landed()
            except Exception as e:  # noqa: BLE001 - the worker's reader of it raises
                self.pages.release_export(offset, pages_bytes + tail_bytes)
                self._send(("export_failed", rid, error_of(e)[1]))
            else:
                self._send(("export_shared", rid, hashes, token_ids, offset, pages_bytes, tail_bytes))

    # ---- the exporter thread ----
    def _export(self) -> None:
        while (item := self.exports.get()) is not None:
            rid, export = item
            try:
                try:
                    hashes, token_ids, pages, tail = export.pages()  # waits for the copy to host memory
                except Exception as e:  # noqa: BLE001 - the worker's reader of it raises
                    self.export_conn.send(("export_failed", rid, error_of(e)[1]))
                else:
                    self.export_conn.send(("export", rid, hashes, token_ids, tail))
                    self.export_conn.send_bytes(pages)
            except (OSError, ValueError):  # the worker is gone
                return
