"""`kill -USR1 <pid>` of a kvmesh service: it prints to stderr where each of its threads is and where
each pending asyncio task waits (their await chains: for an async service the thread stacks only
show the event loop). An engine process prints its threads' stacks (faulthandler).
"""
from __future__ import annotations

import asyncio
import faulthandler
import gc
import signal
import sys


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
    """Every pending asyncio task and its await chain (found through gc: callable from any thread)."""
    tasks = [o for o in gc.get_objects() if issubclass(type(o), asyncio.Task) and not o.done()]
    parts = [f"{len(tasks)} pending asyncio task(s)"]
    for t in tasks:
        parts += [repr(t)[:300], *await_chain(t.get_coro())]
    return "\n".join(parts) + "\n"


def dump(file=None) -> None:
    out = file or sys.stderr
    faulthandler.dump_traceback(file=out, all_threads=True)
    out.write(pending_tasks_report())
    out.flush()


def install_on_loop(loop: asyncio.AbstractEventLoop) -> None:
    """SIGUSR1 dumps threads and tasks (from the loop: the tasks are not changing meanwhile)."""
    loop.add_signal_handler(signal.SIGUSR1, dump)


def install_threads_only() -> None:
    """SIGUSR1 dumps the threads' stacks, even while the main thread is inside a long native call."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
