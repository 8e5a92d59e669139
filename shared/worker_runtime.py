"""The process shell shared by the prefill and decode workers: a grpc.aio server with health checking,
the engine's background loop, the prefix-cache event publisher and the /metrics endpoint.

A role's servicer is built with the runtime's `holder` name and `known_blocks()`, then registered;
`start()` opens the port. Dependencies (engine, index, metrics) come in through the constructor so
tests can share one in-memory index between workers.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.index_feed import INDEX_CALL_TIMEOUT_S, IndexFeed
from kvmesh.telemetry import Metrics, MetricsServer, start_metrics_server
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.worker_config import WorkerConfig

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0  # the publish loop ends within one index call once it sees the stop flag

# Prefill replies and Generate requests carry a full-precision tail block; pages travel on kvstore
# streams, but keep room for big models' tails (70B fp16 tail: 80 * 2 * 8 * 16 * 128 * 2 = 5 MiB).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SERVER_OPTIONS = (("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES))


class WorkerRuntime:
    def __init__(self, cfg: WorkerConfig, role: str, engine: Any, index: Any,
                 metrics: Optional[Metrics] = None) -> None:
        self.cfg = cfg
        self.role = role
        self.engine = engine  # kvmesh.engine.engine_client.EngineClient: in this process or its own
        engine.on_lost = self._engine_lost  # an engine process that dies takes the worker down with it
        self.index = index    # kvmesh.index.PrefixIndex
        self.metrics = metrics or Metrics(model_name=cfg.engine.model, role=role)
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.port = self.server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        if self.port == 0:
            raise RuntimeError(f"--port: could not bind {cfg.host}:{cfg.port}")
        self.holder = cfg.holder(self.port)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._held: set[bytes] = set()
        self.feed = IndexFeed(index, self.holder, lambda: self._held, role, cfg.publish_interval)
        self._drain_lock = asyncio.Lock()
        self._publisher: Optional[asyncio.Task] = None
        self._feed_tick: Optional[asyncio.Task] = None  # the index call in flight, off the publish loop
        self._stopping = False  # the publish loop's exit condition (stop() also cancels it)
        self._metrics_server: Optional[MetricsServer] = None
        self._background: set[asyncio.Task] = set()
        self.max_pending = cfg.max_pending_requests
        self.pending = 0
        self._stopped = asyncio.Event()
        self._stats: Optional[Any] = None  # the engine's last EngineStats (publish loop), for Load
        self._lost_stop: Optional[asyncio.Task] = None  # stop() after the engine process died

    @property
    def address(self) -> str:
        return self.holder

    @property
    def metrics_port(self) -> Optional[int]:
        return self._metrics_server.port if self._metrics_server else None

    def add_servicer(self, register: Callable[[grpc.aio.Server], None]) -> None:
        register(self.server)

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.engine.start()
        await self.server.start()
        await self._set_status(health_pb2.HealthCheckResponse.SERVING)
        self._publisher = asyncio.create_task(self._publish_loop(), name=f"{self.role}-publisher")
        if self.cfg.metrics_port is not None:
            self._metrics_server = await start_metrics_server(self.metrics, self.cfg.host, self.cfg.metrics_port)
        log.info("%s worker serving on %s (holder %s)", self.role, self.port, self.holder)

    async def wait(self) -> None:
        """Until stop() has finished. An Event, not grpc.aio's wait_for_termination(): cancelling
        that (SIGTERM cancels serve()) leaves the server so that the later stop() raises
        CancelledError, skipping the index and engine teardown."""
        await self._stopped.wait()

    async def stop(self, grace: float = 2.0) -> None:
        """Stop accepting calls, let running ones finish for `grace` seconds, then tear down (once)."""
        if self._stopped.is_set():
            return
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)
        if self._background:
            await asyncio.wait(self._background, timeout=grace)
        if self._publisher is not None:
            # the flag as well as the cancel: Python 3.11's asyncio.wait_for (inside redis-py's
            # calls) can swallow a cancel that lands as its call completes (CPython gh-86296);
            # asyncio.wait is bounded and never raises the loop's CancelledError
            self._stopping = True
            tasks = [t for t in (self._publisher, self._feed_tick) if t is not None]
            for t in tasks:
                t.cancel()
            done, _ = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
            if len(done) < len(tasks):
                log.warning("%s: the index publisher did not stop within %.0f s; leaving it", self.role,
                            STOP_TIMEOUT_S)
        with contextlib.suppress(Exception):  # the index may already be gone; entries expire anyway
            await asyncio.wait_for(self.index.drop_holder(self.holder), INDEX_CALL_TIMEOUT_S)
        if self._metrics_server is not None:
            await self._metrics_server.close()
        await self.engine.stop()
        self._stopped.set()

    async def _set_status(self, status: int) -> None:
        await self.health.set("", status)

    def _engine_lost(self, why: str) -> None:
        """The engine process died: every stream has failed; stop serving so the worker exits and
        whoever runs it (`kvmesh up`'s supervisor, Kubernetes) sees it."""
        log.error("%s worker %s: %s; stopping", self.role, self.holder, why)
        self._lost_stop = asyncio.get_running_loop().create_task(self.stop())

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` to completion even if the RPC that started it is cancelled (stop waits for it)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- admission --------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def admitted(self, context: grpc.aio.ServicerContext):
        """Counts the call in flight for its whole life, or refuses it with RESOURCE_EXHAUSTED when
        --max-pending-requests are already in flight (a capacity limit, not a bad request)."""
        if self.max_pending and self.pending >= self.max_pending:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.role} worker {self.holder} has {self.pending} requests in flight "
                                f"(--max-pending-requests {self.max_pending}); retry later or add workers")
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1

    # -- load -------------------------------------------------------------------------------------
    def load_reply(self) -> pb.LoadReply:
        """The Load RPC's answer: the engine's counters as of the last publish tick (every
        --publish-interval) and the calls in flight now. Never waits for the engine thread, so a
        gateway's poll stays cheap however busy the engine is."""
        s = self._stats
        if s is None:
            return pb.LoadReply(pending=self.pending)
        return pb.LoadReply(running=s.num_running, waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
                            pending=self.pending)

    # -- prefix-cache events --------------------------------------------------------------------
    def known_blocks(self) -> set[bytes]:
        """Hashes this worker's engine held as of its last event drain: the publish tick drains every
        --publish-interval (50 ms by default). A request's
        pull reads this and does not wait for a fresh drain, which waits for the engine's step
        boundary and behind its queued commands (in a burst of 256 disaggregated prompts on the
        H200, 0.35-0.47 s of a 0.7-1.0 s pull). A stale view costs at most a page fetched again
        (the import skips pages the engine holds) or one recomputed (evicted since). The live set,
        not a copy: read it before the next await."""
        return self._held

    async def publish_events(self) -> None:
        """Drain the engine's stored/removed events, track them, publish them under `holder`."""
        await self._drain()
        await self.feed.flush()

    async def _drain(self) -> None:
        # On the engine thread, between steps: the engine itself is single-threaded.
        async with self._drain_lock:
            for kind, h in await self.engine.call("drain_kv_events"):
                held = kind == "stored"
                if held:
                    self._held.add(h)
                else:
                    self._held.discard(h)
                self.feed.note(h, held)

    async def _publish_loop(self) -> None:
        while not self._stopping:
            try:
                await self._drain()
                if self._feed_tick is None or self._feed_tick.done():  # a hung index holds its own task,
                    # not this loop: the Load stats below stay fresh (the feed logs an outage itself)
                    self._feed_tick = asyncio.create_task(self.feed.tick())
                self._stats = await self.engine.call("stats")
                self.metrics.update_from_engine_stats(self._stats)
            except asyncio.CancelledError:
                raise
            except Exception:  # the engine's calls: log and keep serving
                log.exception("%s: reading the engine's prefix-cache events or stats failed", self.role)
            await asyncio.sleep(self.cfg.publish_interval)


class Worker:
    """What the prefill and decode workers share: a runtime (gRPC server, health, load, index
    publishing) and a block transfer to the kvstore. Subclasses set `role` and register a servicer."""

    role = ""

    def __init__(self, cfg: WorkerConfig, engine: Any, kvstore: Any, index: Any,
                 metrics: Optional[Metrics] = None) -> None:
        from kvmesh.block_transfer import BlockTransfer, TransferMetrics
        self.runtime = WorkerRuntime(cfg, self.role, engine, index, metrics)
        info = engine.info
        centers = info.key_centers_digest
        model_id = f"{info.model_id}|kc:{centers}" if centers else info.model_id  # pages hold centered keys
        self.transfer = BlockTransfer(kvstore, info.layout, model_id, self.runtime.holder,
                                      cfg.lease_seconds, TransferMetrics(self.runtime.metrics.registry))
        engine.on_import = self.transfer.metrics.imported

    @property
    def address(self) -> str:
        return self.runtime.address

    async def start(self) -> None:
        await self.runtime.start()

    async def stop(self, grace: float = 2.0) -> None:
        await self.runtime.stop(grace)


async def serve_worker(cfg: WorkerConfig, make_worker: Callable[..., Worker],
                       on_ready: Callable[[], None] = lambda: None) -> None:
    """Builds the real engine (in a process of its own unless --no-engine-process), kvstore client
    and index, runs `make_worker(cfg, engine, kvstore, index)` until cancelled (`on_ready()` once it
    serves), then stops it and closes what it used."""
    from kvmesh.index import make_index
    from kvmesh.kvstore.client import GrpcKVStoreClient

    if cfg.engine_process:
        from kvmesh.engine.engine_process import EngineProcess
        engine = EngineProcess(cfg.engine, shared_memory_bytes=cfg.engine_shared_memory_mib << 20)
        await engine.start()  # the model loads in that process; its identity is known after this
    else:
        from kvmesh.engine.async_engine import AsyncEngine
        from kvmesh.engine.engine import LLMEngine
        engine = AsyncEngine(await asyncio.to_thread(LLMEngine, cfg.engine))
    kvstore = GrpcKVStoreClient(list(cfg.kvstore), shared_memory_bytes=cfg.kvstore_shared_memory_mib << 20,
                                block_bytes=engine.info.layout.block_bytes)
    index = make_index(cfg.redis_url)
    worker = make_worker(cfg, engine, kvstore, index)
    try:
        await worker.start()
        on_ready()
        await worker.runtime.wait()
    finally:
        await worker.stop()
        await kvstore.close()
        await index.close()
