"""Prefill worker configuration: the shared worker flags (kvmesh.worker_config) with its own port."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvmesh.worker_config import WorkerConfig, add_worker_args, worker_fields_from_args

DEFAULT_PORT = 50071


@dataclass(frozen=True)
class PrefillConfig(WorkerConfig):
    port: int = DEFAULT_PORT
    """--port: gRPC port (0: any free port)."""


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return add_worker_args(parser, default_port=DEFAULT_PORT)


def from_args(args: argparse.Namespace) -> PrefillConfig:
    return PrefillConfig(**worker_fields_from_args(args))
