"""A test that outlives pytest-timeout's limit prints every pending asyncio task's await chain, then
pytest-timeout's thread method dumps the thread stacks and ends the run (pyproject: timeout_method).

Why not the default signal method: under uvloop the SIGALRM handler runs inside a loop callback and
uvloop logs the exception it raises, so a stuck async test hangs on with no output. And for an async
test the thread stacks only show the event loop; the tasks' await chains show what is stuck.
"""
from __future__ import annotations

import sys
import threading

import pytest

from kvmesh.stack_dump import pending_tasks_report


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
