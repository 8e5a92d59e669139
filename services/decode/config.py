"""Decode worker configuration: the shared worker flags (kvmesh.worker_config) with its own port."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvmesh.worker_config import WorkerConfig, add_worker_args, worker_fields_from_args

DEFAULT_PORT = 50081
DEFAULT_MAX_CHUNK_RATE = 5_000


@dataclass(frozen=True)
class DecodeConfig(WorkerConfig):
    port: int = DEFAULT_PORT
    """--port: gRPC port (0: any free port)."""
    max_chunk_rate: int = DEFAULT_MAX_CHUNK_RATE
    """--max-chunk-rate: stream messages a second this worker sends in all (0: no limit, a message
    a step a stream). Past it each stream's message carries the tokens of several steps: a stream
    waits active streams / rate seconds between messages, so that at hundreds of streams the worker's
    event loop and the gateway's do not spend more on messages than the engine on tokens."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_chunk_rate < 0:
            raise ValueError(f"--max-chunk-rate must be >= 0, got {self.max_chunk_rate}")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_worker_args(parser, default_port=DEFAULT_PORT)
    parser.add_argument("--max-chunk-rate", type=int, default=DEFAULT_MAX_CHUNK_RATE,
                        help="stream messages a second this worker sends in all; past it a message carries "
                             "several tokens (0: one message a step a stream)")
    return parser


def from_args(args: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(**worker_fields_from_args(args), max_chunk_rate=args.max_chunk_rate)
