"""Outages one after another under the soak's load: the kvstore, Redis and the prefill worker frozen
(SIGSTOP), killed (SIGKILL) and brought back, while clients send tests/soak.py's mix. Every outage
here is one the stack must ride out without failing a request: the kvstore and Redis are a cache and
advice, and a prefill worker's prompts go to the decode worker while it is gone.

    report = await run_chaos(services, SoakConfig(seconds=40), CHAOS_SHORT)
"""
from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

from outage_stack import Services
from soak import SoakConfig, SoakReport, run_soak


@dataclass(frozen=True)
class Outage:
    role: str  # kvstore | redis | prefill
    how: str  # freeze | kill
    seconds: float  # how long it stays out


CHAOS_SHORT = (Outage("kvstore", "freeze", 4), Outage("redis", "kill", 3), Outage("prefill", "freeze", 8),
               Outage("kvstore", "kill", 3))
CHAOS_LONG = CHAOS_SHORT + (Outage("redis", "freeze", 4), Outage("prefill", "kill", 5),
                            Outage("kvstore", "freeze", 10), Outage("redis", "kill", 10))


async def _take_out(s: Services, o: Outage) -> None:
    if o.role == "redis":
        if o.how == "freeze":
            s.redis.freeze()
            await asyncio.sleep(o.seconds)
            s.redis.thaw()
        else:
            s.redis.crash()
            await asyncio.sleep(o.seconds)
            await asyncio.to_thread(s.redis.start, port=s.redis.port)
        return
    if o.how == "freeze":
        s.freeze(o.role)
        await asyncio.sleep(o.seconds)
        s.thaw(o.role)
        return
    proc = s.process(o.role)
    os.kill(proc.pid, signal.SIGKILL)
    await asyncio.sleep(o.seconds)
    await asyncio.to_thread(s.restart, o.role)


async def outages(s: Services, plan: tuple[Outage, ...], gap_s: float, log: list[str]) -> None:
    """Each outage of `plan` in turn, `gap_s` of calm between them."""
    for o in plan:
        await asyncio.sleep(gap_s)
        log.append(f"{o.role} {o.how} {o.seconds:g} s")
        await _take_out(s, o)


async def run_chaos(s: Services, cfg: SoakConfig, plan: tuple[Outage, ...]) -> tuple[SoakReport, list[str]]:
    """The soak for `cfg.seconds` with the outages of `plan` spread over it."""
    log: list[str] = []
    gap = max(1.0, cfg.seconds / (len(plan) + 1) - sum(o.seconds for o in plan) / (len(plan) + 1))
    chaos = asyncio.create_task(outages(s, plan, gap, log))
    try:
        report = await run_soak(s.url, "smollm2", cfg)
        await chaos  # the last one ends (and its service is back) before the checks
    finally:
        chaos.cancel()
    return report, log
