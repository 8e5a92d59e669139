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
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
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
