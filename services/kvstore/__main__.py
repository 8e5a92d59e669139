"""python -m kvmesh.kvstore [flags]: run one kvstore node until Ctrl-C / SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kvmesh.kvstore.config import add_cli_args, from_args
from kvmesh.kvstore.server import serve


def main(argv: list[str] | None = None) -> None:
    parser = add_cli_args(argparse.ArgumentParser(prog="kvmesh kvstore", description=__doc__))
    try:
        cfg = from_args(parser.parse_args(argv))
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        # SIGINT too, explicitly: a process started in the background of a script inherits SIGINT
        # ignored, and Python then installs no KeyboardInterrupt handler, so Ctrl-C/kill -INT did
        # nothing until the sender gave up and killed it (the "5-12 s to exit").
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await serve(cfg)
        except asyncio.CancelledError:
            pass

    try:
        import uvloop
        uvloop.run(run())
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
