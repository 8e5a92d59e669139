"""The gateway's aiohttp application: state, middlewares (auth, errors), worker health, `serve(cfg)`."""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

from aiohttp import web
from opentelemetry import trace

from kvmesh.gateway.config import GatewayConfig
from kvmesh.gateway.dispatcher import Dispatcher
from kvmesh.gateway.index_breaker import IndexBreaker
from kvmesh.gateway.metrics import GatewayMetrics
from kvmesh.gateway.openai_api import ApiError
from kvmesh.gateway.router import Router
from kvmesh.gateway.sse import STREAM_OPEN
from kvmesh.gateway.worker_client import WorkerClients
from kvmesh.hashing import HashContext
from kvmesh.telemetry import tracing_middleware

log = logging.getLogger("kvmesh.gateway")


@dataclass
class Gateway:
    """Everything a handler needs; one per app (no module globals)."""

    cfg: GatewayConfig
    tokenizer: Any  # kvmesh.model.tokenizer.Tokenizer
    index: Any  # kvmesh.index.PrefixIndex
    lookups: IndexBreaker  # the index's lookups, bounded and skipped while it fails
    model_id: str
    max_model_len: int
    router: Router
    clients: WorkerClients
    metrics: GatewayMetrics
    dispatcher: Dispatcher
    bulk: ThreadPoolExecutor  # inputs longer than any prompt the context holds (--bulk-threads)
    bulk_slots: asyncio.Semaphore  # big bodies parsed and prepared at once (--bulk-threads): the memory they take
    active: int = 0
    big_bodies: int = 0  # bodies of 1 MB or more read, waiting or prepared now (prompts.body_slot)

    @property
    def served_name(self) -> str:
        return self.cfg.model_names[0]

    def hash_context(self, cache_salt: str) -> HashContext:
        return HashContext(self.model_id, self.cfg.kv_dtype(), self.cfg.block_size, cache_salt)

    async def in_thread(self, fn, *args, bulk: bool = False):
        """fn(*args) off the event loop (with the caller's context: its trace span), on the bulk
        threads where the input is bigger than any prompt the context holds: a client's megabytes
        queue behind each other there, and the default executor's few threads stay free for the
        prompts that fit. A caller cancelled (its client left) still waits for the thread: the work
        holds the input, and the caller's bulk slot (prompts.body_slot) must hold until it is freed."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        work = asyncio.get_running_loop().run_in_executor(self.bulk if bulk else None, call)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            await asyncio.wait([work])
            raise

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.cfg.model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")


GATEWAY = web.AppKey("gateway", Gateway)


def error_response(e: ApiError) -> web.Response:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None  # capacity: come back soon
    return web.json_response(e.body(), status=e.status, headers=headers)


_OPEN_PATHS = ("/health", "/metrics", "/ping")


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    gw = request.app[GATEWAY]
    try:
        key = gw.cfg.api_key
        if key and request.path not in _OPEN_PATHS:
            auth = request.headers.get("Authorization", "")
            if auth != f"Bearer {key}":
                raise ApiError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                               type="authentication_error", code="invalid_api_key")
        return await handler(request)
    except ApiError as e:
        gw.metrics.lab(gw.metrics.request_errors, status=str(e.status)).inc()
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own 404/405 etc., in OpenAI's shape
        err = ApiError(e.status, e.reason or "error", type="invalid_request_error")
        return error_response(err)
    except Exception as e:
        if request.get(STREAM_OPEN):  # the status is sent already: aiohttp ends the stream
            raise
        log.exception("unexpected error serving %s", request.path)
        gw.metrics.lab(gw.metrics.request_errors, status="500").inc()
        return error_response(ApiError(500, f"internal error ({type(e).__name__}); the request was not served",
                                       type="internal_server_error"))


async def _health_loop(gw: Gateway) -> None:
    """Health and load of every worker, every --health-interval-s."""
    clients = list(gw.clients)
    roles = {a: w.role for a, w in gw.router.workers.items()}
    timeout = max(0.2, min(1.0, gw.cfg.health_interval_s))
    while True:
        # all at once: one slow worker must not delay noticing another one's death
        results = await asyncio.gather(*(c.healthy(timeout=timeout) for c in clients),
                                       *(c.load(roles[c.address], timeout=timeout) for c in clients))
        for client, ok, load in zip(clients, results[:len(clients)], results[len(clients):]):
            # other gateways' requests count too (the worker's own count)
            reported = None if load is None else max(load.running + load.waiting, load.pending)
            if gw.router.observe(client.address, ok, reported):
                up = gw.router.workers[client.address].healthy
                log.warning("worker %s is now %s", client.address, "up" if up else "down")
                if not up and (n := gw.dispatcher.worker_down(client.address)):
                    log.warning("%d calls to %s that had answered nothing are routed again", n, client.address)
            elif not gw.router.workers[client.address].healthy and (
                    n := gw.dispatcher.give_up_stalled(client.address, gw.cfg.stalled_stream_timeout_s)):
                log.warning("%d streams of %s, down, sent nothing for %g s and cannot go on elsewhere: "
                            "failed", n, client.address, gw.cfg.stalled_stream_timeout_s)
        await asyncio.sleep(gw.cfg.health_interval_s)


def build_app(cfg: GatewayConfig, *, tokenizer: Any = None, index: Any = None,
              model_id: Optional[str] = None, max_model_len: Optional[int] = None,
              rng: Optional[random.Random] = None, health_checks: bool = True,
              tracer: Optional[trace.Tracer] = None) -> web.Application:
    """The app; the tokenizer, index and model facts load from `cfg` unless given (tests pass theirs).
    tracer: spans of HTTP requests; default the global provider's (`kvmesh gateway --otlp-endpoint`
    installs one with setup_tracing; without it spans are no-ops)."""
    from kvmesh.gateway import handlers  # handlers import this module for GATEWAY

    if tokenizer is None:
        from kvmesh.model.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_model(cfg.model)
    if model_id is None:
        from kvmesh.model.config import model_identity
        model_id = model_identity(cfg.model)
    if max_model_len is None:
        max_model_len = cfg.max_model_len
    if max_model_len is None:
        from kvmesh.model.config import load_model_config
        max_model_len = load_model_config(cfg.model).max_position_embeddings
    tokenizer.fewest_tokens("")  # its first call reads the whole vocabulary (70 ms): not on a request
    if index is None:
        from kvmesh.index import make_index
        index = make_index(cfg.redis_url)
    router = Router(cfg.prefill, cfg.decode, block_size=cfg.block_size, alpha=cfg.route_alpha,
                    beta=cfg.route_beta, store_weight=cfg.route_store_weight,
                    tolerance=cfg.route_tolerance, prefill_threshold_tokens=cfg.prefill_threshold_tokens,
                    rng=rng)
    clients = WorkerClients(list(cfg.prefill) + list(cfg.decode))
    metrics = GatewayMetrics(cfg.model_names[0])
    gw = Gateway(cfg=cfg, tokenizer=tokenizer, index=index,
                 lookups=IndexBreaker(index, cfg.index_timeout_s, metrics.index_error), model_id=model_id,
                 max_model_len=max_model_len, router=router, clients=clients, metrics=metrics,
                 dispatcher=Dispatcher(router, clients, metrics, timeout_s=cfg.request_timeout_s,
                                       detokenize=tokenizer.decode),
                 bulk=ThreadPoolExecutor(cfg.bulk_threads, thread_name_prefix="gateway-bulk"),
                 bulk_slots=asyncio.Semaphore(cfg.bulk_threads))
    for _ in range(cfg.bulk_threads):  # started now: a thread's start waits for the GIL, which a
        gw.bulk.submit(time.sleep, 0.01)  # big body's parse may hold 0.1 s, on the loop
    tracer = tracer or trace.get_tracer("kvmesh.gateway")
    # tracing outermost: its span is current while the handler calls workers, and sees the final status
    app = web.Application(middlewares=[tracing_middleware(tracer), errors_and_auth],
                          client_max_size=64 * 1024 * 1024)
    app[GATEWAY] = gw
    handlers.add_routes(app)

    async def lifecycle(app: web.Application):
        task = asyncio.create_task(_health_loop(gw)) if health_checks else None
        yield
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await clients.close()
        await index.close()
        gw.bulk.shutdown(wait=False, cancel_futures=True)

    app.cleanup_ctx.append(lifecycle)
    return app


async def start(cfg: GatewayConfig, **app_kwargs) -> tuple[web.AppRunner, int]:
    """Build and bind the app; returns the runner (its `.app`) and the bound port. Stop: runner.cleanup()."""
    if cfg.dtype == "auto" and cfg.device == "auto" and cfg.kv_cache_dtype == "auto":
        log.warning("--kv-cache-dtype auto with --dtype auto: assuming CPU workers (fp32 KV) for block "
                    "hashes; pass --dtype or --device as the workers get it, or prefix hits go unseen")
    app = build_app(cfg, **app_kwargs)
    # handler_cancellation: a client that disconnects cancels its handler, hence its gRPC calls.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]  # the real port when cfg.port is 0
    log.info("kvmesh gateway on http://%s:%d/v1 (model %s)", cfg.host, port, cfg.model_names[0])
    return runner, port


async def serve(cfg: GatewayConfig, on_ready: Callable[[], None] = lambda: None, **app_kwargs) -> None:
    """Serve until cancelled; `on_ready()` once it serves."""
    runner, port = await start(cfg, **app_kwargs)
    print(f"kvmesh gateway listening on http://{cfg.host}:{port}/v1", flush=True)
    on_ready()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
