"""LoopWatch logs a service's event loop held by a blocking call, with the stack it is held in, and
says nothing while the loop only waits; under asyncio's loop and uvloop (the services')."""
from __future__ import annotations

import asyncio
import logging
import time

import uvloop

from kvmesh.loop_watch import LoopWatch


def blocking_work(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # held in Python code, as a slab's fill or a long loop holds it
        pass


async def watched(action) -> LoopWatch:
    watch = LoopWatch(threshold_s=0.4, beat_s=0.05)
    watch.start()
    try:
        await action()
        await asyncio.sleep(0.2)  # the loop beats again: "was held" is logged
    finally:
        await watch.stop()
    return watch


async def hold() -> None:
    blocking_work(1.0)


async def wait() -> None:
    await asyncio.sleep(1.0)


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvmesh.loop"]


async def test_a_held_loop_is_logged_with_its_stack_once(caplog):
    with caplog.at_level(logging.WARNING, logger="kvmesh.loop"):
        watch = await watched(hold)
    assert watch.stalls == 1
    held, total = messages(caplog)
    assert "held" in held and "blocking_work" in held and "test_loop_watch.py" in held
    assert total.startswith("the event loop was held") and float(total.split()[-2]) >= 0.9


async def test_a_waiting_loop_says_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="kvmesh.loop"):
        watch = await watched(wait)
    assert watch.stalls == 0 and messages(caplog) == []


def test_under_uvloop_too(caplog):
    with caplog.at_level(logging.WARNING, logger="kvmesh.loop"):
        assert uvloop.run(watched(wait)).stalls == 0
        assert uvloop.run(watched(hold)).stalls == 1
    assert sum("blocking_work" in m for m in messages(caplog)) == 1


async def test_a_service_is_watched_once_it_serves_at_its_threshold(caplog):
    """--loop-watch-seconds: every service's LoopWatch threshold (0: none), from the moment it
    serves: its start-up (imports, a model) held the loop over 1 s on a cold, loaded machine."""
    from kvmesh.cli import serve_until_signal

    async def service(on_ready) -> None:
        blocking_work(0.6)  # starting
        on_ready()
        blocking_work(0.6)  # serving
    for threshold, logged in ((0.4, 1), (0, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvmesh.loop"):
            await serve_until_signal(service, threshold)
        held = [m for m in messages(caplog) if "has been held" in m]
        assert len(held) == logged, (threshold, messages(caplog))
