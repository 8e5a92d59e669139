"""Telemetry: spans reach a real OTLP gRPC receiver, context crosses gRPC metadata and HTTP, metrics expose."""
from __future__ import annotations

import random
import threading
from concurrent import futures
from types import SimpleNamespace

import aiohttp
import grpc
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.telemetry import (Metrics, context_from_grpc, context_from_http, grpc_metadata_with_context,
                              http_headers_with_context, server_span, setup_tracing, start_metrics_server,
                              tracing_middleware)


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP TraceService: keeps every exported span with its resource's service.name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append((attrs.get("service.name"), span))
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def otlp_receiver():
    receiver = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))  # thread pool: see environment.md
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


def test_spans_reach_otlp_receiver_with_propagated_parent(otlp_receiver):
    receiver, endpoint = otlp_receiver
    caller = setup_tracing("kvmesh-gateway", endpoint, set_global=False)
    callee = setup_tracing("kvmesh-decode", endpoint, set_global=False)
    tag = f"req-{random.getrandbits(48):x}"
    with caller.tracer.start_as_current_span("route") as parent:
        parent.set_attribute("request_id", tag)
        metadata = grpc_metadata_with_context([("x-request-id", tag)])
    assert ("x-request-id", tag) in metadata and any(k == "traceparent" for k, _ in metadata)
    fake_ctx = SimpleNamespace(invocation_metadata=lambda: [SimpleNamespace(key=k, value=v) for k, v in metadata])
    with server_span(callee.tracer, "Decode/Generate", fake_ctx) as child:
        child.set_attribute("request_id", tag)
    caller.shutdown()  # flushes: the receiver must hold the spans once shutdown returns
    callee.shutdown()
    callee.shutdown()  # twice is harmless
    by_name = {span.name: (svc, span) for svc, span in receiver.spans}
    assert set(by_name) == {"route", "Decode/Generate"}
    (svc_p, p), (svc_c, c) = by_name["route"], by_name["Decode/Generate"]
    assert (svc_p, svc_c) == ("kvmesh-gateway", "kvmesh-decode")
    assert c.trace_id == p.trace_id and c.parent_span_id == p.span_id
    assert p.trace_id == parent.get_span_context().trace_id.to_bytes(16, "big")


def test_tracing_off_without_endpoint():
    t = setup_tracing("kvmesh-prefill", None)
    assert not t.enabled
    with t.tracer.start_as_current_span("x") as span:
        assert not span.get_span_context().is_valid
    t.shutdown()
    with pytest.raises(ValueError, match="--otlp-endpoint"):
        setup_tracing("kvmesh-prefill", "localhost:4317")


def test_http_context_round_trip():
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("client") as span:
        headers = http_headers_with_context({"Accept": "text/plain"})
    ctx = context_from_http({k.upper(): v for k, v in headers.items()})
    with tracer.start_as_current_span("server", context=ctx) as child:
        assert child.get_span_context().trace_id == span.get_span_context().trace_id
    assert context_from_grpc([("traceparent", headers["traceparent"])]) is not None


async def test_aiohttp_middleware_joins_caller_trace(otlp_receiver):
    receiver, endpoint = otlp_receiver
    tracing = setup_tracing("kvmesh-gateway", endpoint, set_global=False)
    app = web.Application(middlewares=[tracing_middleware(tracing.tracer)])

    async def models(_request):
        return web.json_response({"data": []})

    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    trace_id = random.getrandbits(128) | 1
    traceparent = f"00-{trace_id:032x}-{random.getrandbits(64) | 1:016x}-01"
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/v1/models", headers={"traceparent": traceparent}) as r:
            assert r.status == 200
        async with s.get(f"http://127.0.0.1:{port}/nope") as r:
            assert r.status == 404
    await runner.cleanup()
    tracing.shutdown()
    spans = {span.name: span for _, span in receiver.spans}
    assert spans["GET /v1/models"].trace_id == trace_id.to_bytes(16, "big")
    statuses = {a.key: a.value.int_value for a in spans["GET /v1/models"].attributes}
    assert statuses["http.response.status_code"] == 200


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_exposition_and_server():
    m = Metrics(model_name="smollm2")
    other = Metrics(model_name="smollm2")  # a second registry in the same process must not collide
    q, h = random.randint(100, 1000), random.randint(1, 99)
    stats = SimpleNamespace(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=q,
                            prefix_cache_hits=h, num_preemptions=1, prompt_tokens=q, generation_tokens=7)
    m.update_from_engine_stats(stats)
    m.update_from_engine_stats(SimpleNamespace(**{**vars(stats), "prefix_cache_queries": q + 16,
                                                  "prefix_cache_hits": h + 16}))
    m.time_to_first_token_seconds.observe(0.03)
    m.update_from_store_stats(blocks_held=5, capacity_blocks=64, blocks_evicted=2, bytes_in=4096, bytes_out=1024)
    with m.time_transfer("get"):
        pass
    lbl = (("model_name", "smollm2"),)
    s = _samples(m.exposition().decode())
    assert s[("kvmesh:num_requests_running", lbl)] == 3
    assert s[("kvmesh:num_requests_waiting", lbl)] == 2
    assert s[("kvmesh:kv_cache_usage_perc", lbl)] == 0.25
    assert s[("kvmesh:prefix_cache_queries_total", lbl)] == q + 16
    assert s[("kvmesh:prefix_cache_hits_total", lbl)] == h + 16
    assert s[("kvmesh:num_preemptions_total", lbl)] == 1
    assert s[("kvmesh:prompt_tokens_total", lbl)] == q
    assert s[("kvmesh:generation_tokens_total", lbl)] == 7
    assert s[("kvmesh:time_to_first_token_seconds_count", lbl)] == 1
    assert s[("kvmesh:time_to_first_token_seconds_bucket", (("le", "0.04"),) + lbl)] == 1
    assert s[("kvmesh:time_to_first_token_seconds_bucket", (("le", "0.02"),) + lbl)] == 0
    for name in ("inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        assert s[("kvmesh:" + name, lbl)] == 0
    assert s[("kvmesh:store_blocks_held", ())] == 5
    assert s[("kvmesh:store_blocks_evicted_total", ())] == 2
    assert s[("kvmesh:store_bytes_in_total", ())] == 4096
    assert s[("kvmesh:store_bytes_out_total", ())] == 1024
    assert s[("kvmesh:store_transfer_seconds_count", (("op", "get"),))] == 1
    assert _samples(other.exposition().decode())[("kvmesh:prefix_cache_queries_total", lbl)] == 0

    server = await start_metrics_server(m, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as sess:
            async with sess.get(f"http://127.0.0.1:{server.port}/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                body = await r.text()
        assert _samples(body)[("kvmesh:prefix_cache_hits_total", lbl)] == h + 16
    finally:
        await server.close()


async def test_grpc_client_interceptors_carry_trace_context():
    from opentelemetry.sdk.trace import TracerProvider

    from kvmesh.telemetry import tracing_client_interceptors

    seen: list[dict] = []

    async def echo(request: bytes, context) -> bytes:
        seen.append(dict(context.invocation_metadata()))
        return request

    async def echo_stream(request: bytes, context):
        seen.append(dict(context.invocation_metadata()))
        for i in range(3):
            yield request + bytes([i])

    ident = lambda b: b  # noqa: E731  raw bytes on the wire: no protobuf needed
    handler = grpc.method_handlers_generic_handler("t.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(echo, ident, ident),
        "Stream": grpc.unary_stream_rpc_method_handler(echo_stream, ident, ident),
    })
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tracer = TracerProvider().get_tracer("t")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=tracing_client_interceptors()) as ch:
            payload = random.randbytes(16)
            with tracer.start_as_current_span("call") as span:
                unary = ch.unary_unary("/t.Echo/Unary", request_serializer=ident, response_deserializer=ident)
                assert await unary(payload, metadata=(("x-id", "7"),)) == payload
                stream = ch.unary_stream("/t.Echo/Stream", request_serializer=ident, response_deserializer=ident)
                assert [m async for m in stream(payload)] == [payload + bytes([i]) for i in range(3)]
            assert await unary(payload) == payload  # outside any span: no traceparent
    finally:
        await server.stop(None)
    want = f"00-{span.get_span_context().trace_id:032x}-{span.get_span_context().span_id:016x}-"
    assert seen[0]["traceparent"].startswith(want) and seen[0]["x-id"] == "7"
    assert seen[1]["traceparent"].startswith(want)
    assert "traceparent" not in seen[2]
