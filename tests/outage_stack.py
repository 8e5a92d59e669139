"""A stack of service processes for outage tests and benchmarks: a real redis-server, one kvstore,
one prefill and one decode worker, a gateway (`kvmesh kvstore|prefill|decode|gateway`, the command
lines `kvmesh up` builds with --redis-url), each a process of its own so that one can be killed,
frozen or restarted under the others. The gateway sends every uncached prompt to the prefill worker,
so each request crosses the kvstore.

    with outage_stack(log_path) as services:
        text, cached = await answer(services.url, salt)
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass

import aiohttp
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
    url: str
    metrics: dict[str, str]  # service name -> /metrics
    log_path: str  # every service's output

    def log_lines(self, needle: str) -> list[str]:
        with open(self.log_path) as f:
            return [line.rstrip() for line in f if needle in line]

    def errors(self) -> list[str]:
        return (self.log_lines(" ERROR ") + self.log_lines("Traceback"))[:20]

    def others_alive(self) -> list[str]:
        """Names of the services (the kvstore aside) whose latest process has exited."""
        latest = {c.name: c for c in self.supervisor.children}
        return [n for n, c in latest.items() if c.role != "kvstore" and c.returncode() is not None]

    @property
    def kvstore(self) -> ServiceProcess:
        return self.process("kvstore")

    async def sample(self, service: str, name: str, **labels: str) -> float:
        """One sample of a service's /metrics (0 where it has none yet)."""
        async with aiohttp.ClientSession() as s, s.get(self.metrics[service]) as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return 0.0

    async def pushes_again(self) -> bool:
        """Whether a fresh prompt's blocks now reach the kvstore (the prefill worker's pushes grow)."""
        before = await self.sample("prefill-0", "kvmesh:worker_blocks_total", op="pushed")
        await answer(self.url, f"probe-{time.monotonic()}")
        return await self.sample("prefill-0", "kvmesh:worker_blocks_total", op="pushed") > before

    def freeze_kvstore(self) -> None:
        self.freeze("kvstore")

    def thaw_kvstore(self) -> None:
        self.thaw("kvstore")

    def freeze(self, role: str) -> None:
        """SIGSTOP: it accepts connections and answers nothing, as in a partition."""
        os.kill(self.process(role).pid, signal.SIGSTOP)

    def thaw(self, role: str) -> None:
        os.kill(self.process(role).pid, signal.SIGCONT)

    def process(self, role: str) -> ServiceProcess:
        """The latest process of `role` (one service a role here)."""
        return [c for c in self.supervisor.children if c.role == role][-1]

    def restart_kvstore(self) -> None:
        self.restart("kvstore")

    def restart(self, role: str) -> None:
        """Starts `role` again, its old process gone, with the same command line (its port too)."""
        old = self.process(role)
        proc = ServiceProcess(old.name, role, old.argv, old.health)
        self.supervisor.spawn(proc)
        deadline = time.monotonic() + STARTUP_S
        while not probe(proc.health, 1.0)[0]:
            assert proc.returncode() is None and time.monotonic() < deadline, proc.last_lines()
            time.sleep(0.2)


@contextlib.contextmanager
def outage_stack(log_path: str):
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
        yield Services(redis, supervisor, plan.url, plan.metrics_urls, log_path)
    finally:
        supervisor.stop({"gateway": 0, "prefill": 1, "decode": 1, "kvstore": 2}, 15.0)
        redis.stop()
        log.close()


async def answer(url: str, salt: str) -> tuple[str, int]:
    """A greedy answer to PROMPT under cache salt `salt`, and its cached prompt tokens."""
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as oa:
        r = await oa.chat.completions.create(model="smollm2", messages=PROMPT, max_tokens=12, temperature=0,
                                             extra_body={"cache_salt": salt})
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


async def timed_answers(url: str, tag: str, n: int) -> list[tuple[str, float]]:
    """`n` greedy answers one after another, each under a fresh cache salt, with their seconds."""
    out = []
    for i in range(n):
        t0 = time.monotonic()
        text, _ = await answer(url, f"{tag}-{i}-{t0}")
        out.append((text, time.monotonic() - t0))
    return out


async def until(what: str, check, timeout_s: float = RECOVERY_S):
    """Polls the coroutine function `check` until it returns something true."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what}")
        await asyncio.sleep(0.5)
