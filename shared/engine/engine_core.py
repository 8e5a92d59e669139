"""EngineCore: the engine in a process of its own (`EngineProcess` spawns it), so that its steps
never wait for the GIL of the worker's event loop, which speaks gRPC to every stream.

One duplex pipe to the worker. The main thread runs the engine: commands between steps, one step
at a time, and each step's outputs as one message. Three helper threads keep it from waiting on the
pipe: a reader (commands into a queue), a sender (pickles and writes every message) and an exporter
(waits for a finished request's KV pages to land in host memory, then sends their bytes after the
output that announced them).

Messages, worker -> core: ("call", id, method, args, kwargs), ("import", id, hashes, token ids,
cache salt) and right after it each page raw (an `import_blocks` call), ("abort", request_id), ("stop",).
Core -> worker: ("ready", EngineInfo) | ("failed", why) first; then ("result", id, ok, value),
("outputs", [RequestOutput]) (prompt ids left out: the worker has them; a KV export as
`ExportPending`), ("export", request_id, hashes, token ids, tail) and right after it the pages'
bytes back to back as one raw message (written from the pinned copy: no pickling, no bytes object
a page), or ("export_failed", request_id, why), and ("step_failed", error).
"""
from __future__ import annotations

import logging
import queue
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from kvmesh.config import EngineConfig
from kvmesh.engine.engine_info import EngineInfo
from kvmesh.engine.outputs import ExportedBlock

if TYPE_CHECKING:
    from kvmesh.engine.engine import LLMEngine

log = logging.getLogger(__name__)

# what the worker may ask of the engine between steps
CALLS = frozenset({"add_request", "abort", "import_blocks", "drain_kv_events", "stats", "has_unfinished",
                   "request_ids"})


@dataclass(frozen=True)
class ExportPending:
    """Stands for a finished request's KVExport in its output; the bytes follow as an "export" message."""

    tail_tokens: int
    tail_dtype: str


def error_of(exc: BaseException) -> tuple[bool, str]:
    """An exception as (is a ValueError, message): what crosses the pipe (exceptions need not pickle)."""
    text = str(exc) if isinstance(exc, (ValueError, RuntimeError)) else f"{type(exc).__name__}: {exc}"
    return isinstance(exc, ValueError), text


def run_engine_core(config: EngineConfig, conn: Connection) -> None:
    """The engine process's entry point: builds the engine, says so, serves until told to stop or
    the worker's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker, which stops this process
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from kvmesh.engine.engine import LLMEngine  # here, not at import: the worker's side needs no torch
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - reported to the worker, which raises it
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", EngineInfo.of(engine)))
    EngineCore(engine, conn).run()


class EngineCore:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # commands; None: the worker is gone
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # messages to send; None: stop sending
        self.exports: queue.SimpleQueue = queue.SimpleQueue()  # (request id, KVExport); None: stop

    def run(self) -> None:
        helpers = [threading.Thread(target=f, name=f"kvmesh-core-{f.__name__.strip('_')}", daemon=True)
                   for f in (self._read, self._send, self._export)]
        for t in helpers:
            t.start()
        try:
            self._serve()
        finally:
            self.exports.put(None)
            helpers[2].join()
            self.outbox.put(None)
            helpers[1].join()
            self.conn.close()

    # ---- main thread ----
    def _serve(self) -> None:
        while True:
            block = not self.engine.has_unfinished()  # idle: sleep until a command comes
            while True:
                try:
                    msg = self.inbox.get(block=block)
                except queue.Empty:
                    break
                block = False
                if msg is None or msg[0] == "stop":
                    return
                self._handle(msg)
            if self.engine.has_unfinished():
                self._step()

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "abort":
            self.engine.abort(msg[1])
            return
        _, cid, method, args, kwargs = msg
        try:
            if method not in CALLS:
                raise ValueError(f"the engine process has no call {method!r}")
            res = getattr(self.engine, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the caller's error, raised in the worker
            self.outbox.put(("result", cid, False, error_of(e)))
        else:
            self.outbox.put(("result", cid, True, res))

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # a failed step fails every request in flight, not the process
            log.exception("engine step failed")
            for rid in self.engine.request_ids():
                self.engine.abort(rid)
            self.outbox.put(("step_failed", error_of(e)))
            return
        if not outs:
            return
        exports = []
        for o in outs:
            o.prompt_token_ids = []  # the worker has them; sent every step they would cost the most
            if o.kv_export is not None:
                exports.append((o.request_id, o.kv_export))
                o.kv_export = ExportPending(o.kv_export.tail_tokens, o.kv_export.tail_dtype)
        self.outbox.put(("outputs", outs))
        for e in exports:  # after the output that announces them
            self.exports.put(e)

    # ---- helper threads ----
    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
                if msg[0] == "import":  # the pages follow, raw: a call of import_blocks
                    _, cid, hashes, token_ids, salt = msg
                    blocks = [ExportedBlock(h, t, self.conn.recv_bytes()) for h, t in zip(hashes, token_ids)]
                    msg = ("call", cid, "import_blocks", (blocks, salt), {})
            except (EOFError, OSError):
                self.inbox.put(None)
                return
            self.inbox.put(msg)

    def _send(self) -> None:
        while (msg := self.outbox.get()) is not None:
            try:
                if msg[0] == "export":  # the header, then the pages raw
                    self.conn.send(msg[:-1])
                    self.conn.send_bytes(msg[-1])
                else:
                    self.conn.send(msg)
            except (OSError, ValueError):  # the worker is gone; the reader ends the loop
                return

    def _export(self) -> None:
        while (item := self.exports.get()) is not None:
            rid, export = item
            try:
                hashes, token_ids, pages, tail = export.pages()  # waits for the copy to host memory
            except Exception as e:  # noqa: BLE001 - the worker's reader of it raises
                self.outbox.put(("export_failed", rid, error_of(e)[1]))
            else:
                self.outbox.put(("export", rid, hashes, token_ids, tail, pages))
