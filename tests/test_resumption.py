"""A streamed greedy choice whose decode worker hangs (SIGSTOP) or dies (SIGKILL) mid-stream goes on
on the other decode worker from the tokens already sent: the client's text and usage equal an
uninterrupted run's (services/gateway/resumption.py). One that cannot go on elsewhere (a stop
string) fails with an in-band error once its hung worker has sent nothing for
--stalled-stream-timeout, not after gRPC's keepalive. `kvmesh up` with two decode workers, SmolLM2."""
from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import pytest

from kvmesh.launcher import Stack, StackConfig
from soak import metric_sums

STARTUP_S = 400
MAX_TOKENS = 48
STALLED_S = 5.0  # the gateway's --stalled-stream-timeout here
MESSAGES = [{"role": "user", "content": "Write a long list of tools found in a hardware store."}]


def _running(metrics_url: str) -> float:
    async def read():
        import aiohttp
        async with aiohttp.ClientSession() as s:
            return (await metric_sums(s, metrics_url)).get("kvmesh:num_requests_running", 0.0)
    return asyncio.run(read())


def _gateway_counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


def _stream_interrupted(stack: Stack, salt: str, interrupt, **extra) -> tuple[str, object]:
    """Streams a greedy answer; after a few chunks calls `interrupt(decode worker serving it)`."""
    import openai

    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "cache_salt": salt}, **extra)
    text, usage, chunks = [], None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            chunks += 1
            if chunks == 4:
                serving = [c for c in stack.children if c.role == "decode"
                           and _running(stack.metrics_urls[c.name]) > 0]
                assert len(serving) == 1, serving
                interrupt(serving[0])
    return "".join(text), usage


@pytest.mark.timeout(STARTUP_S + 400)
def test_a_stream_goes_on_on_the_other_decode_worker_when_its_own_hangs_or_dies():
    import openai

    cfg = StackConfig(port=0, num_prefill=0, num_decode=2, metrics=True, startup_timeout_s=STARTUP_S,
                      log_level="warning", kvstore_capacity_bytes=64 << 20,
                      engine_flags=("--max-num-seqs", "4", "--kv-cache-memory", "48MiB", "--max-model-len", "512"),
                      extra_args=(("gateway", ("--stalled-stream-timeout", str(STALLED_S))),))
    with Stack(cfg) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=300)
        ref = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True, "cache_salt": "ref"})
        reference = ref.choices[0].message.content

        frozen = []
        text, usage = _stream_interrupted(stack, "hung",
                                          lambda p: (frozen.append(p), os.kill(p.pid, signal.SIGSTOP)))
        try:
            assert text == reference
            assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens == ref.usage.prompt_tokens
        finally:
            os.kill(frozen[0].pid, signal.SIGCONT)
        _wait_all_healthy(stack.url)

        # a stop string: the rest cannot be generated elsewhere exactly, so the stream fails, and soon
        frozen.clear()
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="stopped answering health checks"):
            _stream_interrupted(stack, "hung-stop", lambda p: (frozen.append(p), os.kill(p.pid, signal.SIGSTOP)),
                                stop=["no such stop string"])
        failed_after = time.monotonic() - started
        os.kill(frozen[0].pid, signal.SIGCONT)
        # down after the health checks' ~3-7 s, then STALLED_S without a chunk (gRPC's keepalive: ~80 s)
        assert failed_after < STALLED_S + 25, failed_after
        _wait_all_healthy(stack.url)

        text, usage = _stream_interrupted(stack, "dead", lambda p: os.kill(p.pid, signal.SIGKILL))
        assert text == reference
        assert usage.completion_tokens == MAX_TOKENS and usage.prompt_tokens == ref.usage.prompt_tokens
        assert _gateway_counter(stack.url, "kvmesh:resumed_choices_total") == 2


def _wait_all_healthy(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # a thawed worker answers its health checks again
        if all(w["healthy"] for w in _workers(url)):
            return
        time.sleep(0.5)


def _workers(url: str) -> list[dict]:
    import json
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return list(json.loads(r.read())["workers"].values())
