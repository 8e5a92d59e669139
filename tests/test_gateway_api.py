"""Gateway HTTP surface that needs no worker: models, tokenize, errors, auth, metrics, SSE, no torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvmesh.gateway import sse
from kvmesh.gateway.app import GATEWAY, build_app
from kvmesh.gateway.config import GatewayConfig, add_cli_args, from_args
from kvmesh.index import MemoryIndex
from kvmesh.wire import kvmesh_pb2 as pb

DEAD = ("127.0.0.1:9", "127.0.0.1:7")  # nothing listens on discard/echo ports


@pytest.fixture(scope="module")
def model_facts():
    from kvmesh.model.config import model_identity
    from kvmesh.model.tokenizer import Tokenizer
    return Tokenizer.from_model("smollm2"), model_identity("smollm2")


async def start(model_facts, **cfg_kw) -> TestClient:
    tok, mid = model_facts
    cfg = GatewayConfig(**{"decode": DEAD, "max_model_len": 64, **cfg_kw})
    app = build_app(cfg, tokenizer=tok, index=MemoryIndex(), model_id=mid, health_checks=False)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest.fixture
async def client(model_facts):
    c = await start(model_facts)
    yield c
    await c.close()


def assert_error(body: dict, param, code=None) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code
    assert err["message"]


def test_gateway_imports_no_torch():
    code = ("import sys, kvmesh.gateway.app, kvmesh.gateway.handlers, kvmesh.gateway.__main__, "
            "kvmesh.model.tokenizer, kvmesh.model.config, kvmesh.index; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_config_flags_and_errors():
    import argparse
    p = add_cli_args(argparse.ArgumentParser())
    cfg = from_args(p.parse_args(["--decode", "h:1", "--decode", "h:2", "--prefill", "h:3",
                                  "--kv-cache-dtype", "fp8", "--served-model-name", "a", "b"]))
    assert cfg.decode == ("h:1", "h:2") and cfg.prefill == ("h:3",) and cfg.model_names == ("a", "b")
    assert cfg.kv_dtype() == "fp8_e4m3"
    assert GatewayConfig(decode=("h:1",)).kv_dtype() == "fp32"  # auto on the CPU, as the engine does
    assert GatewayConfig(decode=("h:1",), device="cuda").kv_dtype() == "bf16"
    for kw, flag in (({"decode": ()}, "--decode"), ({"decode": ("nohost",)}, "--decode"),
                     ({"decode": ("h:1",), "block_size": 7}, "--block-size"),
                     ({"decode": ("h:1",), "prefill": ("x",)}, "--prefill"),
                     ({"decode": ("h:1",), "max_num_requests": 0}, "--max-num-requests")):
        with pytest.raises(ValueError, match=flag):
            GatewayConfig(**kw)


async def test_models_and_health(client):
    r = await client.get("/v1/models")
    body = await r.json()
    assert r.status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["smollm2"] and body["data"][0]["max_model_len"] == 64
    r = await client.get("/health")
    assert r.status == 200 and (await r.json())["workers"][DEAD[0]]["role"] == "decode"
    assert (await (await client.get("/v1/models/smollm2")).json())["id"] == "smollm2"
    r = await client.get("/v1/models/other")
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    assert (await client.get("/ping")).status == 200
    assert (await (await client.get("/version")).json())["version"]


async def test_tokenize_detokenize_roundtrip(client, model_facts):
    tok, _ = model_facts
    text = "The quick brown fox jumps over the lazy dog 12345."
    r = await client.post("/tokenize", json={"model": "smollm2", "prompt": text, "return_token_strs": True})
    body = await r.json()
    assert r.status == 200
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 64 and len(body["token_strs"]) == body["count"]
    r = await client.post("/detokenize", json={"model": "smollm2", "tokens": body["tokens"]})
    assert (await r.json())["prompt"] == tok.decode(body["tokens"])
    msgs = [{"role": "user", "content": "hello"}]
    r = await client.post("/tokenize", json={"messages": msgs})
    assert (await r.json())["tokens"] == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", {"model": "smollm2"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                              "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                              "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                              "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                              "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/completions", {"model": "smollm2"}, 400, "prompt"),
    ("/v1/completions", {"model": "smollm2", "prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": "smollm2", "prompt": [999999]}, 400, "prompt"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "stop": [f"s{i}" for i in range(257)]}, 400, "stop"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                              "stop": ["x" * 1025]}, 400, "stop"),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"model": "smollm2", "prompt": ["a"] * 20, "n": 20}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/v1/completions", {"model": "smollm2", "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "smollm2", "prompt": "x", "logit_bias": {"-5": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "smollm2", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "smollm2", "prompt": "x", "logit_bias": {"5": "high"}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "smollm2", "prompt": "x", "logit_bias": [5, 1]}, 400, "logit_bias"),
    # past int32 (the wire's integers): were 500s from protobuf's range check
    ("/v1/completions", {"model": "smollm2", "prompt": "x", "logit_bias": {"99999999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "smollm2", "prompt": "x", "stop_token_ids": [2**40]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": "smollm2", "prompt": [2**40]}, 400, "prompt"),
    ("/v1/completions", {"model": "smollm2", "prompt": "x", "top_k": 2**40}, 400, "top_k"),
    ("/v1/completions", {"model": "smollm2", "prompt": "x", "min_tokens": 2**40}, 400, "min_tokens"),
    # refused, not silently ignored: no tool-call parser, no guided decoding
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/completions", {"model": "smollm2", "prompt": "x", "guided_json": {"type": "object"}}, 400, "guided_json"),
])
async def test_bad_input_gets_openai_shaped_4xx(client, path, body, status, param):
    r = await client.post(path, json=body)
    assert r.status == status, await r.text()
    assert_error(await r.json(), param)


def test_what_is_not_refused_of_tools_and_formats():
    from kvmesh.gateway.openai_api import parse_chat
    base = {"model": "smollm2", "messages": [{"role": "user", "content": "x"}]}
    tools = [{"type": "function", "function": {"name": "f"}}]
    for extra in ({"tools": tools, "tool_choice": "none"}, {"tools": []}, {"tool_choice": "auto"},
                  {"response_format": {"type": "text"}}, {"guided_json": None}):
        assert parse_chat({**base, **extra}).messages[0]["content"] == "x"


async def test_malformed_json_and_non_object(client):
    r = await client.post("/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status == 400
    assert_error(await r.json(), None, "invalid_json")
    r = await client.post("/v1/completions", json=[1, 2])
    assert r.status == 400
    assert_error(await r.json(), None)
    # an integer of over 4,300 digits: json.loads raises a plain ValueError, which was a 500
    r = await client.post("/v1/completions", data=b'{"model": "smollm2", "prompt": "x", "max_tokens": ' + b"9" * 5000
                          + b"}", headers={"Content-Type": "application/json"})
    assert r.status == 400, await r.text()
    assert_error(await r.json(), None, "invalid_json")


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/chat/completions", b'{"model": "smollm2", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "smollm2", "messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}',
     "messages[0].content"),  # the surrogate's own bytes, which json.loads lets through
    ("/v1/completions", b'{"model": "smollm2", "prompt": "x", "stop": ["ok", "\\udc00"]}', "stop[1]"),
    ("/v1/completions", b'{"model": "smollm2", "prompt": "x", "logit_bias": {"\\ud801": 1}}', "logit_bias"),
    ("/tokenize", b'{"prompt": "\\ude00 alone"}', "prompt"),
])
async def test_unpaired_surrogate_is_a_400_not_a_500(client, path, raw, param):
    # JSON lets a lone "\ud800" through, and no tokenizer takes it: it was a 500 with a text body
    r = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
    assert r.status == 400, await r.text()
    assert_error(await r.json(), param, "invalid_json")


async def test_paired_surrogates_and_deep_nesting(client):
    r = await client.post("/tokenize", data=b'{"prompt": "smile \\ud83d\\ude00"}',
                          headers={"Content-Type": "application/json"})  # an escaped emoji is one character
    assert r.status == 200 and (await r.json())["count"] > 1
    r = await client.post("/v1/completions", data=b"[" * 100_000, headers={"Content-Type": "application/json"})
    assert r.status == 400
    assert_error(await r.json(), None, "invalid_json")


async def test_unexpected_fault_is_an_openai_shaped_500_and_the_gateway_serves_on(client):
    class Broken:
        def encode(self, *a, **kw):
            raise RuntimeError("tokenizer fell over")

    gw = client.server.app[GATEWAY]
    tok, gw.tokenizer = gw.tokenizer, Broken()
    try:
        r = await client.post("/tokenize", json={"prompt": "hello"})
        assert r.status == 500
        err = (await r.json())["error"]
        assert err["type"] == "internal_server_error" and "RuntimeError" in err["message"]
    finally:
        gw.tokenizer = tok
    r = await client.post("/tokenize", json={"prompt": "hello"})
    assert r.status == 200


async def test_too_long_prompt_names_max_model_len(client):
    r = await client.post("/v1/completions", json={"model": "smollm2", "prompt": "word " * 80, "max_tokens": 4})
    body = await r.json()
    assert r.status == 400
    assert_error(body, "prompt", "context_length_exceeded")
    assert "64" in body["error"]["message"] and "--max-model-len" in body["error"]["message"]
    r = await client.post("/v1/chat/completions", json={
        "model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60})
    assert r.status == 400 and (await r.json())["error"]["param"] == "messages"


async def test_unknown_route_is_openai_shaped_404(client):
    r = await client.get("/v1/nothing")
    assert r.status == 404 and "error" in await r.json()


async def test_api_key(model_facts):
    c = await start(model_facts, api_key="s3cret")
    try:
        r = await c.get("/v1/models")
        assert r.status == 401
        assert_error(await r.json(), None, "invalid_api_key")
        r = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status == 401
        r = await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert r.status == 200
        assert (await c.get("/health")).status == 200  # probes need no key
    finally:
        await c.close()


async def test_dead_workers_give_503_and_are_marked_down(client):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 503, await r.text()
    assert (await r.json())["error"]["type"] == "service_unavailable"
    gw = client.server.app[GATEWAY]
    assert gw.router.healthy("decode") == []  # both tried, both marked down
    r = await client.get("/health")
    assert r.status == 503
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status == 503  # no stream opened before the first token
    metrics = await (await client.get("/metrics")).text()
    assert 'kvmesh:request_errors_total{model_name="smollm2",status="503"} 2.0' in metrics
    assert 'kvmesh:router_decisions_total{model_name="smollm2",reason="miss_short_prefix"}' in metrics


async def test_capacity_limit_is_429(client):
    gw = client.server.app[GATEWAY]
    gw.active = gw.cfg.max_num_requests
    r = await client.post("/v1/completions", json={"model": "smollm2", "prompt": "hi"})
    assert r.status == 429 and (await r.json())["error"]["type"] == "rate_limit_exceeded"
    assert r.headers["Retry-After"] == "1"
    gw.active = 0


async def test_metrics_names(client):
    text = await (await client.get("/metrics")).text()
    for name in ("kvmesh:prefix_cache_queries_total", "kvmesh:prefix_cache_hits_total",
                 "kvmesh:time_to_first_token_seconds", "kvmesh:inter_token_latency_seconds",
                 "kvmesh:e2e_request_latency_seconds", "kvmesh:prompt_tokens_total",
                 "kvmesh:generation_tokens_total", "kvmesh:num_requests_running",
                 "kvmesh:num_requests_waiting", "kvmesh:router_decisions_total",
                 "kvmesh:router_predicted_hit_tokens_total", "kvmesh:router_actual_hit_tokens_total"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name


def test_sse_framing_roundtrip():
    chunks = [{"id": "x", "choices": [{"delta": {"content": "héllo\n\nworld"}}]}, {"usage": None}]
    raw = b"".join(sse.event(c) for c in chunks) + sse.DONE
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"\n\n") == 3  # newlines inside are escaped
    assert sse.parse(raw) == chunks + ["[DONE]"]
    with pytest.raises(ValueError, match="data field"):
        sse.parse(b"event: x\n\n")


def test_completion_logprobs_echo_shape():
    from kvmesh.gateway.responses import completion_logprobs
    texts = {1: "a", 2: "bc", 3: "d", 4: "e"}
    plps = [pb.TokenLogprob(), pb.TokenLogprob(token_id=2, logprob=-1.5, top=[pb.TopLogprob(token_id=4, logprob=-0.5)])]
    gen = [pb.TokenLogprob(token_id=3, logprob=-0.25)]
    out = completion_logprobs([1, 2], plps, gen, texts.__getitem__)
    assert out == {"tokens": ["a", "bc", "d"], "token_logprobs": [None, -1.5, -0.25],
                   "top_logprobs": [None, {"e": -0.5, "bc": -1.5}, {"d": -0.25}], "text_offset": [0, 1, 3]}
    # a worker that leaves position 0 out entirely
    assert completion_logprobs([1, 2], plps[1:], [], texts.__getitem__)["token_logprobs"] == [None, -1.5]
    json.dumps(out)


async def test_health_loop_marks_workers_by_grpc_health(model_facts):
    """A real grpc.health.v1 server: SERVING -> up, NOT_SERVING -> down, nothing listening -> down."""
    import asyncio

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    live = f"127.0.0.1:{port}"
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    tok, mid = model_facts
    cfg = GatewayConfig(decode=(live, DEAD[0]), max_model_len=64, health_interval_s=0.05)
    app = build_app(cfg, tokenizer=tok, index=MemoryIndex(), model_id=mid)
    c = TestClient(TestServer(app))
    await c.start_server()
    try:
        router = app[GATEWAY].router

        async def wait_for(addr: str, healthy: bool) -> None:
            for _ in range(200):
                if router.workers[addr].healthy == healthy:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"{addr} never became {'up' if healthy else 'down'}")

        await wait_for(DEAD[0], False)
        assert router.workers[live].healthy
        await hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await wait_for(live, False)
        assert (await c.get("/health")).status == 503
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)
        await wait_for(live, True)
        assert (await c.get("/health")).status == 200
    finally:
        await c.close()
        await server.stop(0)


async def test_long_text_tokenized_off_loop_matches(client, model_facts):
    tok, _ = model_facts
    text = "lorem ipsum dolor sit amet " * 800  # > GIL_FREE_CHARS: the threaded path
    r = await client.post("/tokenize", json={"prompt": text})
    assert (await r.json())["tokens"] == tok.encode(text)
