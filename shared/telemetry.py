"""Tracing (OpenTelemetry over OTLP gRPC) and Prometheus metrics for every kvmesh process. No torch.

- `setup_tracing(service_name, endpoint)` -> `Tracing`: an OTLP gRPC exporter when an endpoint is
  given (`--otlp-endpoint` / OTEL_EXPORTER_OTLP_ENDPOINT), a no-op tracer otherwise. Call
  `Tracing.shutdown()` on exit: it flushes what is buffered (before the collector goes away).
- Trace context crosses process boundaries as W3C `traceparent` in gRPC metadata and HTTP headers
  (`grpc_metadata_with_context` / `context_from_grpc`, `tracing_client_interceptors` for grpc.aio
  channels, `http_headers_with_context` /
  `context_from_http`, `tracing_middleware` for aiohttp servers, `server_span` for gRPC servicers).
- `Metrics`: one Prometheus registry per process, passed around (no module globals), with vLLM's
  engine metric names under the `kvmesh:` prefix plus the kvstore's own; `start_metrics_server`
  serves it at GET /metrics for workers that have no HTTP server of their own.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# ---------------------------------------------------------------------------------------------
# tracing
# ---------------------------------------------------------------------------------------------


@dataclass
class Tracing:
    """A process's tracer and the provider behind it (None when tracing is off)."""

    tracer: trace.Tracer
    provider: Optional[Any] = None  # opentelemetry.sdk.trace.TracerProvider
    endpoint: Optional[str] = None

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def shutdown(self) -> None:
        """Flush and stop the exporter. Safe to call twice and when tracing is off."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None


def setup_tracing(service_name: str, endpoint: Optional[str] = None, *, set_global: bool = True,
                  export_timeout_s: float = 5.0) -> Tracing:
    """Tracer for `service_name` (e.g. "kvmesh-gateway"); spans go to the OTLP gRPC `endpoint`.

    endpoint: "http://host:4317" (plain text) or "https://host:4317"; None or "" = tracing off.
    set_global: also install the provider as OpenTelemetry's global one (once per process), so that
    libraries using `trace.get_tracer` report into it too.
    """
    if not endpoint:
        return Tracing(trace.NoOpTracer())
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if "://" not in endpoint:
        raise ValueError(f"--otlp-endpoint must look like http://host:4317, got {endpoint!r}")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"),
                                timeout=export_timeout_s)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    if set_global:
        trace.set_tracer_provider(provider)
    return Tracing(provider.get_tracer("kvmesh"), provider, endpoint)


def _propagator() -> TraceContextTextMapPropagator:
    return TraceContextTextMapPropagator()


def grpc_metadata_with_context(metadata: Optional[Sequence[tuple[str, str]]] = None,
                               context: Optional[Context] = None) -> list[tuple[str, str]]:
    """Client side: `metadata` plus the current (or given) span's `traceparent`."""
    carrier: dict[str, str] = {}
    _propagator().inject(carrier, context=context)
    return list(metadata or ()) + sorted(carrier.items())


def context_from_grpc(metadata: Any) -> Context:
    """Server side: the caller's trace context from `servicer_context.invocation_metadata()`
    (pairs or objects with .key/.value) or from a servicer context itself."""
    if hasattr(metadata, "invocation_metadata"):
        metadata = metadata.invocation_metadata()
    carrier: dict[str, str] = {}
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if isinstance(value, str):
            carrier[key.lower()] = value
    return _propagator().extract(carrier)


def http_headers_with_context(headers: Optional[Mapping[str, str]] = None,
                              context: Optional[Context] = None) -> dict[str, str]:
    """Outgoing HTTP request headers plus the current span's `traceparent`."""
    out = dict(headers or {})
    _propagator().inject(out, context=context)
    return out


def context_from_http(headers: Mapping[str, str]) -> Context:
    """The caller's trace context from incoming HTTP headers (case-insensitive mapping)."""
    carrier = {k.lower(): v for k, v in headers.items()}
    return _propagator().extract(carrier)


def tracing_client_interceptors() -> list:
    """grpc.aio client interceptors that add the current span's `traceparent` to every call's metadata:
    `grpc.aio.insecure_channel(addr, interceptors=tracing_client_interceptors())`."""
    import grpc

    def with_context(details):
        return details._replace(metadata=grpc.aio.Metadata(*grpc_metadata_with_context(details.metadata or ())))

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(with_context(details), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(with_context(details), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, details, request_iterator):
            return await continuation(with_context(details), request_iterator)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, request_iterator):
            return await continuation(with_context(details), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


@contextlib.contextmanager
def server_span(tracer: trace.Tracer, name: str, grpc_context: Any) -> Iterator[trace.Span]:
    """A SERVER span for one gRPC call, a child of the caller's span when it sent one. Not made the
    current span: a streaming handler is an async generator that gRPC may close from another task
    when the caller hangs up, where a context attached at its start cannot be detached (OTel logs
    an error each time); the workers start no spans and send no traced calls of their own."""
    span = tracer.start_span(name, context=context_from_grpc(grpc_context), kind=trace.SpanKind.SERVER)
    try:
        yield span
    except Exception as e:
        span.record_exception(e)
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(e).__name__}: {e}"))
        raise
    finally:
        span.end()


def tracing_middleware(tracer: trace.Tracer):
    """aiohttp middleware: one SERVER span per request, joined to the caller's trace."""
    from aiohttp import web

    @web.middleware
    async def middleware(request: web.Request, handler):
        route = request.match_info.route.resource
        path = route.canonical if route is not None else request.path
        with tracer.start_as_current_span(f"{request.method} {path}", context=context_from_http(request.headers),
                                          kind=trace.SpanKind.SERVER) as span:
            span.set_attribute("http.request.method", request.method)
            span.set_attribute("url.path", request.path)
            try:
                response = await handler(request)
            except web.HTTPException as e:
                span.set_attribute("http.response.status_code", e.status)
                raise
            span.set_attribute("http.response.status_code", response.status)
            return response

    return middleware


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------
PREFIX = "kvmesh:"
# Same buckets as vLLM's, so dashboards built for it read ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# EngineStats field -> (counter attribute) for cumulative counts turned into counter increments.
_ENGINE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                    "generation_tokens")


@dataclass
class Metrics:
    """One process's Prometheus registry and the metrics kvmesh reports (vLLM names, `kvmesh:` prefix).

    Engine metrics carry the label `model_name` (bound here, so callers just `.inc()` / `.set()`).
    """

    model_name: str = ""
    role: str = ""
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _last: dict[str, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        r, m = self.registry, [self.model_name]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, ["model_name"], registry=r).labels(*m)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name"], registry=r).labels(*m)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=r).labels(*m)

        # engine (prefill / decode workers; the gateway reports the request-level ones)
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage: 1 = every block in use.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recomputed) for lack of blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.time_to_first_token_seconds = histogram(
            "time_to_first_token_seconds", "Time to the first generated token.", TTFT_BUCKETS)
        self.inter_token_latency_seconds = histogram(
            "inter_token_latency_seconds", "Time between consecutive generated tokens.", ITL_BUCKETS)
        self.e2e_request_latency_seconds = histogram(
            "e2e_request_latency_seconds", "Request latency from arrival to last token.", E2E_BUCKETS)
        # kvstore
        self.store_blocks_held = Gauge(PREFIX + "store_blocks_held", "Blocks held by this kvstore node.",
                                       registry=r)
        self.store_capacity_blocks = Gauge(PREFIX + "store_capacity_blocks", "Blocks this kvstore node can hold.",
                                           registry=r)
        self.store_blocks_evicted = Counter(PREFIX + "store_blocks_evicted", "Blocks evicted (LRU).", registry=r)
        self.store_bytes_in = Counter(PREFIX + "store_bytes_in", "Block bytes received (put).", registry=r)
        self.store_bytes_out = Counter(PREFIX + "store_bytes_out", "Block bytes sent (get).", registry=r)
        self.store_put_wait_seconds = Counter(PREFIX + "store_put_wait_seconds",
                                              "Seconds put calls gave way to gets in progress (pulls first).",
                                              registry=r)
        self.store_transfer_seconds = Histogram(PREFIX + "store_transfer_seconds",
                                                "Duration of one put or get stream.", ["op"],
                                                buckets=TRANSFER_BUCKETS, registry=r)

    # -- helpers for cumulative sources (EngineStats, the store's stats) --------------------------
    def _advance(self, key: str, metric: Counter, total: float) -> None:
        """Counters only go up: add what the cumulative `total` gained since the last call."""
        delta = total - self._last.get(key, 0.0)
        if delta > 0:
            metric.inc(delta)
        self._last[key] = max(total, self._last.get(key, 0.0))

    def update_from_engine_stats(self, stats: Any) -> None:
        """Copy a `kvmesh.engine` EngineStats snapshot (cumulative counters) into the metrics."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        for name in _ENGINE_COUNTERS:
            self._advance(name, getattr(self, name), getattr(stats, name))

    def update_from_store_stats(self, *, blocks_held: int, capacity_blocks: int, blocks_evicted: int,
                                bytes_in: int, bytes_out: int, put_wait_seconds: float = 0.0) -> None:
        """Copy a kvstore's cumulative counters (as in StatsReply) into the metrics."""
        self.store_blocks_held.set(blocks_held)
        self.store_capacity_blocks.set(capacity_blocks)
        self._advance("store_blocks_evicted", self.store_blocks_evicted, blocks_evicted)
        self._advance("store_bytes_in", self.store_bytes_in, bytes_in)
        self._advance("store_bytes_out", self.store_bytes_out, bytes_out)
        self._advance("store_put_wait_seconds", self.store_put_wait_seconds, put_wait_seconds)

    @contextlib.contextmanager
    def time_transfer(self, op: str) -> Iterator[None]:
        """`with metrics.time_transfer("get"): ...` observes store_transfer_seconds{op}."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.store_transfer_seconds.labels(op).observe(time.perf_counter() - start)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (what GET /metrics returns)."""
        return generate_latest(self.registry)


def metrics_handler(metrics: Metrics):
    """aiohttp handler for GET /metrics."""
    from aiohttp import web

    async def handle(_request: web.Request) -> web.Response:
        resp = web.Response(body=metrics.exposition())
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    return handle


@dataclass
class MetricsServer:
    """A running aiohttp server for GET /metrics (and GET /health); `port` is the bound port."""

    runner: Any
    port: int

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_metrics_server(metrics: Metrics, host: str = "0.0.0.0", port: int = 0) -> MetricsServer:
    """Serve `metrics` at http://host:port/metrics on the running loop (port 0 = pick a free one)."""
    from aiohttp import web

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(metrics))
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # aiohttp exposes no public bound-port accessor
    return MetricsServer(runner, bound)
