"""`python -m kvmesh.gateway --decode HOST:PORT [--prefill HOST:PORT] ...` runs the gateway."""
from __future__ import annotations

import argparse
import logging
import sys

from kvmesh.gateway.config import add_cli_args, from_args


def main(argv: list[str] | None = None) -> None:
    parser = add_cli_args(argparse.ArgumentParser(prog="kvmesh gateway",
                                                  description="OpenAI-compatible HTTP gateway"))
    args = parser.parse_args(argv)
    try:
        cfg = from_args(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvloop

    from kvmesh.gateway.app import serve
    try:
        uvloop.run(serve(cfg))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
