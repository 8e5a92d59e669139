"""Outages of what the services lean on, as on Kubernetes where each service restarts on its own:
the kvstore, then Redis, killed (SIGKILL) under a serving stack and started again on the same port,
and Redis frozen (SIGSTOP: it accepts connections and answers nothing, as in a network partition).

While one is gone every request still answers, greedy-identical, and no other service dies: the
kvstore is a cache (a prompt whose blocks cannot be pushed or pulled is recomputed) and the index is
advice (a lookup that fails routes the request as a miss). Once it is back, the stack uses it again
without a restart of anything: blocks reach the new kvstore, block hashes the new Redis, and a
repeated prompt hits the cache again. A frozen Redis costs a request at most --index-timeout.

Every service is a process of its own (`kvmesh kvstore|prefill|decode|gateway`, the command lines
`kvmesh up` builds), the index a real redis-server; the gateway sends every uncached prompt to the
prefill worker, so each request crosses the kvstore.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.launcher import Stack, StackConfig
from kvmesh.supervisor import ServiceProcess, Supervisor, probe
from redis_server import RedisServer

STARTUP_S = 400  # two workers load SmolLM2 on a shared 2-core machine
RECOVERY_S = 60.0  # for a restarted dependency to be used again
PROMPT = [{"role": "system", "content": "You answer in one short sentence about tools. " * 6},
          {"role": "user", "content": "Which tool drives a screw?"}]


@dataclass
class Services:
    redis: RedisServer
    supervisor: Supervisor
    kvstore: ServiceProcess
    url: str
    metrics: dict[str, str]  # service name -> /metrics
    log_path: str  # every service's output

    def log_lines(self, needle: str) -> list[str]:
        with open(self.log_path) as f:
            return [line.rstrip() for line in f if needle in line]

    def errors(self) -> list[str]:
        return (self.log_lines(" ERROR ") + self.log_lines("Traceback"))[:20]

    def others_alive(self) -> list[str]:
        """Names of the services (the kvstore aside) that have exited."""
        return [c.name for c in self.supervisor.children if c.role != "kvstore" and c.returncode() is not None]

    async def sample(self, service: str, name: str, **labels: str) -> float:
        """One sample of a service's /metrics (0 where it has none yet)."""
        async with aiohttp.ClientSession() as s, s.get(self.metrics[service]) as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return 0.0

    def restart_kvstore(self) -> None:
        proc = ServiceProcess(self.kvstore.name, "kvstore", self.kvstore.argv, self.kvstore.health)
        self.supervisor.spawn(proc)
        self.kvstore = proc
        deadline = time.monotonic() + 60
        while not probe(proc.health, 1.0)[0]:
            assert proc.returncode() is None and time.monotonic() < deadline, proc.last_lines()
            time.sleep(0.2)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("outages") / "services.log")
    log = open(log_path, "w")
    redis = RedisServer().start()
    plan = Stack(StackConfig(port=0, redis_url=redis.url, metrics=True, log_level="warning",
                             kvstore_capacity_bytes=64 << 20, startup_timeout_s=STARTUP_S,
                             engine_flags=("--max-num-seqs", "4", "--max-model-len", "512",
                                           "--kv-cache-memory", "48MiB"),
                             extra_args=(("gateway", ("--prefill-threshold-tokens", "0")),)))
    supervisor = Supervisor(log)
    try:
        for wave in plan._plan():
            for proc in wave:
                supervisor.spawn(proc)
            supervisor.wait_healthy(wave, STARTUP_S, threading.Event())
        kvstore = next(c for c in supervisor.children if c.role == "kvstore")
        yield Services(redis, supervisor, kvstore, plan.url, plan.metrics_urls, log_path)
    finally:
        supervisor.stop({"gateway": 0, "prefill": 1, "decode": 1, "kvstore": 2}, 15.0)
        redis.stop()
        log.close()


async def _answer(url: str, salt: str) -> tuple[str, int]:
    """A greedy answer to PROMPT under cache salt `salt`, and its cached prompt tokens."""
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as oa:
        r = await oa.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=12, temperature=0,
                                             extra_body={"cache_salt": salt})
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


async def _until(what: str, check, timeout_s: float = RECOVERY_S):
    """Polls the coroutine function `check` until it returns something true."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what}")
        await asyncio.sleep(0.5)


@pytest.mark.timeout(STARTUP_S + 600)
async def test_kvstore_outage_recomputes_then_the_restarted_store_is_used(services: Services):
    reference, _ = await _answer(services.url, "before")
    pushed = await services.sample("prefill-0", "kvmesh:worker_blocks_total", op="pushed")
    assert pushed > 0, "the healthy stack pushed no blocks to the kvstore"

    services.kvstore.popen.kill()
    services.kvstore.popen.wait()
    errors = await services.sample("prefill-0", "kvmesh:worker_transfer_errors_total", op="push")
    for salt in ("store-down-1", "store-down-2"):  # nothing cached under these: the whole prompt runs
        assert await _answer(services.url, salt) == (reference, 0)
    assert await services.sample("prefill-0", "kvmesh:worker_transfer_errors_total", op="push") > errors, \
        "the prefill worker never missed the store"
    assert not services.others_alive(), services.others_alive()

    services.restart_kvstore()
    pushed = await services.sample("prefill-0", "kvmesh:worker_blocks_total", op="pushed")

    async def store_used_again():
        assert (await _answer(services.url, f"store-back-{time.monotonic()}"))[0] == reference
        return await services.sample("prefill-0", "kvmesh:worker_blocks_total", op="pushed") > pushed

    await _until("the prefill worker pushes to the restarted kvstore", store_used_again)
    assert not services.others_alive(), services.others_alive()
    assert not services.errors(), "\n".join(services.errors())


@pytest.mark.timeout(600)
async def test_redis_outage_routes_as_misses_then_the_restarted_index_fills_again(services: Services):
    import redis.asyncio as aredis

    reference, _ = await _answer(services.url, "before-redis")
    r = aredis.Redis.from_url(services.redis.url)
    try:
        async def published():
            return set(await r.keys("kvmesh:blk:*"))

        before = await _until("the stack's blocks are in Redis", published)
        services.redis.crash()
        for salt in ("index-down-1", "index-down-1"):  # the second hits the worker's own pages
            text, _ = await _answer(services.url, salt)
            assert text == reference
        assert not services.others_alive(), services.others_alive()

        services.redis.start(port=services.redis.port)  # empty: what was published is gone

        async def republished():  # by every holder, with no request to prompt it
            return before <= await published()

        await _until("the holders republish what they held to the restarted Redis", republished)
    finally:
        await r.aclose()
    text, cached = await _answer(services.url, "index-down-1")
    assert text == reference and cached > 0, (text, cached)
    assert not services.others_alive(), services.others_alive()
    outage_lines = services.log_lines("prefix index does not answer")
    assert 1 <= len(outage_lines) <= 3, outage_lines  # once a publishing service (kvstore, prefill, decode)
    assert not services.errors(), "\n".join(services.errors())


@pytest.mark.timeout(600)
async def test_a_frozen_redis_costs_a_request_at_most_the_index_timeout(services: Services):
    reference, _ = await _answer(services.url, "before-freeze")
    t0 = time.monotonic()
    await _answer(services.url, "healthy-timing")
    healthy = time.monotonic() - t0
    timeouts = await services.sample("gateway", "kvmesh:prefix_index_errors_total", model_name="smollm2",
                                     reason="timeout")
    services.redis.freeze()
    try:
        for i in range(3):
            t0 = time.monotonic()
            text, _ = await _answer(services.url, f"frozen-{i}")
            took = time.monotonic() - t0
            assert text == reference
            # --index-timeout is 1 s; without it each lookup waited for redis-py's 5 s socket timeout
            assert took < healthy + 2.5, (took, healthy)
        assert await services.sample("gateway", "kvmesh:prefix_index_errors_total", model_name="smollm2",
                                     reason="timeout") > timeouts
        assert not services.others_alive(), services.others_alive()
    finally:
        services.redis.thaw()

    async def gateway_routes_by_the_index_again():
        await _answer(services.url, "after-thaw")
        return [line for line in services.log_lines("; routing by it") if "[gateway]" in line]

    await _until("the gateway looks the index up again", gateway_routes_by_the_index_again)
    assert not services.errors(), "\n".join(services.errors())


@pytest.mark.timeout(600)
async def test_a_frozen_kvstore_costs_the_requests_in_flight_a_bounded_wait_and_the_rest_nothing(
        services: Services):
    reference, _ = await _answer(services.url, "before-store-freeze")
    t0 = time.monotonic()
    await _answer(services.url, "store-healthy-timing")
    healthy = time.monotonic() - t0
    os.kill(services.kvstore.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    took = []
    try:
        for i in range(3):
            t0 = time.monotonic()
            text, _ = await _answer(services.url, f"store-frozen-{i}")
            took.append(time.monotonic() - t0)
            assert text == reference
        assert not services.others_alive(), services.others_alive()
    finally:
        os.kill(services.kvstore.pid, signal.SIGCONT)
    # the first waits for its put's deadline (5 s and its bytes), then the node is skipped until it
    # answers a health check: before, every request waited for a 30 s put and a 30 s get (61 s)
    assert took[0] < healthy + 8 and max(took[1:]) < healthy + 2.5, (took, healthy)
    pushed = await services.sample("prefill-0", "kvmesh:worker_blocks_total", op="pushed")

    async def store_used_again():
        await _answer(services.url, f"store-thawed-{time.monotonic()}")
        return await services.sample("prefill-0", "kvmesh:worker_blocks_total", op="pushed") > pushed

    await _until("the prefill worker pushes to the kvstore again", store_used_again)
    assert not services.errors(), "\n".join(services.errors())
