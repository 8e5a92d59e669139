"""Moves KV pages between the kvstore and a worker's local engine, byte for byte (never re-quantized).

    pull: kvstore Get (leased while in flight; on one host straight into the engine's imports
          segment) -> EngineClient.import_blocks -> kvstore Release
    push: the engine's KVExport blocks the store lacks -> kvstore Put

Used by the prefill and decode workers. It sits at the services layer (it speaks to the kvstore
client), but lives in `kvmesh` because two services share it and a service imports no other service.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Collection, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvmesh.engine.outputs import ExportedBlock
from kvmesh.kv.layout import BlockLayout
from kvmesh.kvstore.block import StoredBlock
from kvmesh.outage import Outage
from kvmesh.telemetry import PREFIX, TRANSFER_BUCKETS

log = logging.getLogger(__name__)


def layout_id(model_id: str, layout: BlockLayout) -> str:
    """What must match for a stored page to be readable here (the store checks nothing inside it)."""
    return (f"{model_id}|{layout.kv_dtype}|bs{layout.block_size}|L{layout.num_layers}"
            f"|H{layout.kv_heads}|D{layout.head_dim}")


@dataclass(frozen=True)
class PullResult:
    imported: list[bytes]
    """Hashes fetched from the kvstore and imported into the local prefix cache, in order."""
    missing: int
    """Requested blocks the store no longer had (or had in another layout): they get recomputed."""
    nbytes: int
    seconds: float
    error: str = ""
    """Why the store could not be read (the request goes on and recomputes)."""
    get_seconds: float = 0.0
    """Of `seconds`, the kvstore get (the rest: a wait for import room, the import and the release)."""
    import_seconds: float = 0.0
    """Of `seconds`, the import into the engine (it waits for a step boundary)."""


@dataclass(frozen=True)
class PushResult:
    stored: int
    """Blocks sent to the kvstore."""
    nbytes: int
    seconds: float
    error: str = ""
    """Why the store could not be written (readers will recompute those blocks)."""


class TransferMetrics:
    """A worker's block traffic with the kvstore, on the worker's own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.blocks = Counter(PREFIX + "worker_blocks", "KV blocks moved between this worker and the kvstore.",
                              ["op"], registry=registry)  # op: pulled | missing | pushed
        self.bytes = Counter(PREFIX + "worker_transfer_bytes", "KV page bytes moved to/from the kvstore.",
                             ["op"], registry=registry)
        self.seconds = Histogram(PREFIX + "worker_transfer_seconds",
                                 "One pull (get+import+release), its get (pull_get) and import (pull_import), a push, "
                                 "or the wait for a finished prompt's pages to leave the engine (export).",
                                 ["op"], buckets=TRANSFER_BUCKETS, registry=registry)
        self.exports = Counter(PREFIX + "worker_exports", "Finished prompts' KV exports from the engine process, "
                               "by the way their pages came (shared_memory | pipe).", ["path"], registry=registry)
        self.imports = Counter(PREFIX + "worker_imports", "Imports into the engine, by the way their pages came "
                               "(in_place | shared_memory | pipe | in_process).", ["path"], registry=registry)
        self.errors = Counter(PREFIX + "worker_transfer_errors", "kvstore calls that failed (recomputed).",
                              ["op"], registry=registry)

    def pulled(self, r: "PullResult") -> None:
        self.blocks.labels("pulled").inc(len(r.imported))
        self.blocks.labels("missing").inc(r.missing)
        self.bytes.labels("pull").inc(r.nbytes)
        self.seconds.labels("pull").observe(r.seconds)
        if r.get_seconds:
            self.seconds.labels("pull_get").observe(r.get_seconds)
        if r.import_seconds:
            self.seconds.labels("pull_import").observe(r.import_seconds)
        if r.error:
            self.errors.labels("pull").inc()

    def exported(self, seconds: float, shared: bool) -> None:
        self.seconds.labels("export").observe(seconds)
        self.exports.labels("shared_memory" if shared else "pipe").inc()

    def imported(self, path: str) -> None:
        self.imports.labels(path).inc()

    def pushed(self, r: "PushResult") -> None:
        self.blocks.labels("pushed").inc(r.stored)
        self.bytes.labels("push").inc(r.nbytes)
        self.seconds.labels("push").observe(r.seconds)
        if r.error:
            self.errors.labels("push").inc()


class BlockTransfer:
    """One worker's path to the kvstore: pulls prefixes into its engine, pushes what it computed."""

    def __init__(self, kvstore: Any, layout: BlockLayout, model_id: str, holder: str,
                 lease_seconds: float, metrics: TransferMetrics | None = None) -> None:
        self.kvstore = kvstore  # kvmesh.kvstore.client.KVStoreClient
        self.layout = layout
        self.layout_id = layout_id(model_id, layout)
        self.holder = holder
        self.lease_seconds = lease_seconds
        self.metrics = metrics
        self._unreachable = Outage()  # every node down: logged once, until a call goes through again

    def _failed(self, what: str, e: Exception) -> None:
        """A kvstore call failed. With every node down (the client raises a ConnectionError without
        calling) that is once an outage, not once a request; `worker_transfer_errors_total` counts each."""
        if not isinstance(e, ConnectionError):
            log.warning("kvstore %s: %s", what, e)
        elif self._unreachable.failed():
            log.warning("kvstore %s: %s; recomputing what it would serve until a node answers (logged once)",
                        what, e)

    def _answered(self) -> None:
        lasted = self._unreachable.answered()
        if lasted is not None:
            log.warning("a kvstore node answers again after %.1f s", lasted)

    async def pull(self, engine: Any, hashes: Sequence[bytes], cache_salt: str = "",
                   local: Collection[bytes] = ()) -> PullResult:
        """Imports the longest prefix of `hashes` available locally or in the kvstore into `engine`
        (an EngineClient). Blocks in `local` (in the engine's prefix cache, as far as the worker
        knows: `WorkerRuntime.known_blocks`) are not fetched. A block the store lacks ends the
        prefix: the engine recomputes from there."""
        r = await self._pull(engine, hashes, cache_salt, local)
        if self.metrics is not None:
            self.metrics.pulled(r)
        return r

    async def push(self, blocks: Sequence[ExportedBlock], known: Collection[bytes] = ()) -> PushResult:
        """Puts `blocks` the kvstore lacks; `known` are hashes already known to be there (skipped
        without asking). Returns what was sent."""
        r = await self._push(blocks, known)
        if self.metrics is not None:
            self.metrics.pushed(r)
        return r

    async def _pull(self, engine: Any, hashes: Sequence[bytes], cache_salt: str,
                    local: Collection[bytes]) -> PullResult:
        start = time.perf_counter()
        want = [h for h in hashes if h not in local]
        if not want:
            return PullResult([], 0, 0, 0.0)
        # where the engine copies imports from (an engine process's imports segment): the kvstore
        # writes the pages there, so the worker copies none of them
        space = await engine.reserve_import(len(want) * self.layout.block_bytes)
        t_get = time.perf_counter()  # the get's time leaves out a wait for that room
        handed = False
        try:
            try:
                got = await self.kvstore.get(want, lease_holder=self.holder, lease_seconds=self.lease_seconds,
                                             into=space)
            except Exception as e:  # no store reachable: a cache miss, not a failed request
                self._failed(f"get of {len(want)} blocks failed, recomputing them", e)
                return PullResult([], len(want), 0, time.perf_counter() - start, error=str(e))
            self._answered()
            try:
                usable: list[ExportedBlock] = []
                for h, blk in zip(want, got):
                    if blk is None or blk.layout != self.layout_id or len(blk.data) != self.layout.block_bytes:
                        break
                    usable.append(ExportedBlock(hash=h, token_ids=list(blk.token_ids), data=blk.data,
                                                shared=blk.shared))
                # Everything before the first gap is a contiguous chain together with the local blocks.
                chain_end = len(usable)
                t_import = time.perf_counter()
                if usable:
                    handed = True  # the import takes the range over, whatever happens
                    await engine.import_blocks(usable, cache_salt, reserved=space)
                t_imported = time.perf_counter()
            finally:
                leased = [h for h, blk in zip(want, got) if blk is not None]
                if leased:
                    try:
                        await self.kvstore.release(leased, self.holder)
                    except Exception as e:  # the leases expire after --lease-seconds anyway
                        self._failed(f"release of {len(leased)} blocks failed", e)
        finally:
            if not handed:
                engine.release_import(space)
        nbytes = sum(len(b.data) for b in usable)
        return PullResult([b.hash for b in usable], len(want) - chain_end, nbytes, time.perf_counter() - start,
                          get_seconds=t_import - t_get, import_seconds=t_imported - t_import)

    async def _push(self, blocks: Sequence[ExportedBlock], known: Collection[bytes]) -> PushResult:
        start = time.perf_counter()
        todo = [b for b in blocks if b.hash not in known]
        try:
            if todo:
                present = await self.kvstore.contains([b.hash for b in todo])
                todo = [b for b, p in zip(todo, present) if not p]
            if todo:
                await self.kvstore.put([StoredBlock(hash=b.hash, token_ids=list(b.token_ids), data=b.data,
                                                    layout=self.layout_id, shared=b.shared) for b in todo])
        except Exception as e:  # the store is advisory for correctness: readers recompute
            self._failed(f"put of {len(todo)} blocks failed", e)
            return PushResult(0, 0, time.perf_counter() - start, error=str(e))
        self._answered()
        return PushResult(len(todo), sum(len(b.data) for b in todo), time.perf_counter() - start)
