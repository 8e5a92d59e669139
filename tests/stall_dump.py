"""A test that outlives pytest-timeout's limit prints every pending asyncio task's await chain, then
pytest-timeout's thread method dumps the thread stacks and ends the run (pyproject: timeout_method).

Why not the default signal method: under uvloop the SIGALRM handler runs inside a loop callback and
uvloop logs the exception it raises, so a stuck async test hangs on with no output. And for an async
test the thread stacks only show the event loop; the tasks' await chains show what is stuck.
"""
from __future__ import annotations

import asyncio
import gc
import sys
import threading

import pytest


def _attr(obj, *names):
    return next((v for v in (getattr(obj, n, None) for n in names) if v is not None), None)


def await_chain(coro) -> list[str]:
    """Where a suspended coroutine waits, outermost first: one line per coroutine/generator frame."""
    lines = []
    while coro is not None:
        frame = _attr(coro, "cr_frame", "gi_frame", "ag_frame")
        if frame is not None:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        coro = _attr(coro, "cr_await", "gi_yieldfrom", "ag_await")
    return lines


def pending_tasks_report() -> str:
    # gc, not asyncio.all_tasks(loop): this runs on the timer thread, which knows no loop.
    tasks = [o for o in gc.get_objects() if issubclass(type(o), asyncio.Task) and not o.done()]
    parts = [f"{len(tasks)} pending asyncio task(s)"]
    for t in tasks:
        parts += [repr(t), *await_chain(t.get_coro())]
    return "\n".join(parts) + "\n"


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's thread timer, with the task report written first (it lands in the captured
    stderr that pytest-timeout prints before the stacks)."""
    if settings.method != "thread":
        return None
    import pytest_timeout

    def fire() -> None:
        sys.stderr.write(f"\n+++ {item.nodeid}: over {settings.timeout} s; {pending_tasks_report()}")
        sys.stderr.flush()
        pytest_timeout.timeout_timer(item, settings)  # dumps captured output and stacks, os._exit(1)

    timer = threading.Timer(settings.timeout, fire)
    timer.name = f"stall_dump {item.nodeid}"

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel
    timer.start()
    return True
