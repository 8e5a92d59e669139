"""What a prefill or decode worker process is configured with: engine flags plus where it listens,
which kvstore nodes and which prefix index it talks to. No torch.

`kvmesh.prefill.config` and `kvmesh.decode.config` subclass `WorkerConfig` (own default port, own
extra flags) so the two roles parse the same flags the same way.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

from kvmesh.config import EngineConfig
from kvmesh.engine_args import add_engine_args, engine_config_from_args


def _check_address(flag: str, addr: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{flag} expects host:port, got {addr!r}")


class _AppendOverridingDefault(argparse._AppendAction):  # argparse has no public base for this
    """Repeatable flag whose command-line values replace its default (e.g. one from KVMESH_KVSTORE)
    instead of being appended to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine flags (--model, --kv-cache-dtype, ...), see kvmesh.engine_args."""
    kvstore: tuple[str, ...] = ()
    """--kvstore: host:port of a kvstore node (repeatable; at least one). Blocks shard over them."""
    host: str = "127.0.0.1"
    """--host: address the gRPC server binds (0.0.0.0 for every interface)."""
    port: int = 0
    """--port: gRPC port (0: any free port)."""
    advertise_address: Optional[str] = None
    """--advertise-address: host:port others reach this worker at (its holder name in the index)."""
    redis_url: Optional[str] = None
    """--redis-url / --index-url: the prefix index; none = an in-process memory index."""
    metrics_port: Optional[int] = None
    """--metrics-port: HTTP port serving Prometheus /metrics (0: any free port); none = off."""
    lease_seconds: float = 30.0
    """--lease-seconds: how long kvstore keeps blocks this worker is pulling from being evicted."""
    publish_interval: float = 0.05
    """--publish-interval: seconds between batched prefix-cache event publishes to the index."""
    max_pending_requests: int = 256
    """--max-pending-requests: calls in flight (running + queued) beyond which new ones get
    RESOURCE_EXHAUSTED (the gateway answers 429); 0 = no limit."""
    engine_process: bool = True
    """--engine-process / --no-engine-process: run the engine in a process of its own (its steps
    never wait for the GIL of the gRPC event loop), or in a thread of the worker's."""
    kvstore_shared_memory_mib: int = 64
    """--kvstore-shared-memory-mib: a segment of /dev/shm through which blocks move to and from the
    kvstore nodes on this host (the others, and calls it has no room for, use gRPC messages); 0 = off."""
    engine_shared_memory_mib: int = 256
    """--engine-shared-memory-mib: two segments of /dev/shm (half each) through which the engine
    process hands exported pages to the worker and takes imported ones (a transfer they have no
    room for, or 0 = off, goes through the pipes)."""

    def __post_init__(self) -> None:
        if not self.kvstore:
            raise ValueError("--kvstore: give at least one kvstore node address (host:port)")
        for a in self.kvstore:
            _check_address("--kvstore", a)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.advertise_address is not None:
            _check_address("--advertise-address", self.advertise_address)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.lease_seconds <= 0:
            raise ValueError(f"--lease-seconds must be positive, got {self.lease_seconds}")
        if self.publish_interval <= 0:
            raise ValueError(f"--publish-interval must be positive, got {self.publish_interval}")
        if self.max_pending_requests < 0:
            raise ValueError(f"--max-pending-requests must be >= 0, got {self.max_pending_requests}")
        if self.kvstore_shared_memory_mib < 0:
            raise ValueError(f"--kvstore-shared-memory-mib must be >= 0, got {self.kvstore_shared_memory_mib}")
        if self.engine_shared_memory_mib < 0:
            raise ValueError(f"--engine-shared-memory-mib must be >= 0, got {self.engine_shared_memory_mib}")

    def holder(self, bound_port: int) -> str:
        """The name this worker publishes in the index: --advertise-address or host:bound port."""
        if self.advertise_address:
            return self.advertise_address
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{bound_port}"


def add_worker_args(parser: argparse.ArgumentParser, default_port: int) -> argparse.ArgumentParser:
    """Engine flags plus the worker's own (KVMESH_<FLAG> env defaults come from kvmesh.cli)."""
    add_engine_args(parser)
    d = WorkerConfig(kvstore=("x:1",))
    g = parser.add_argument_group("worker")
    g.add_argument("--kvstore", action=_AppendOverridingDefault, default=None, metavar="HOST:PORT",
                   help="kvstore node (repeatable, or comma-separated)")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=default_port)
    g.add_argument("--advertise-address", default=None, metavar="HOST:PORT")
    g.add_argument("--redis-url", "--index-url", dest="redis_url", default=None,
                   help="prefix index (redis://...); default an in-process memory index")
    g.add_argument("--metrics-port", type=int, default=None)
    g.add_argument("--lease-seconds", type=float, default=d.lease_seconds)
    g.add_argument("--publish-interval", type=float, default=d.publish_interval)
    g.add_argument("--max-pending-requests", type=int, default=d.max_pending_requests,
                   help="calls in flight beyond which new ones are refused (0 = no limit)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=d.engine_process,
                   help="run the engine in a process of its own (default) or in a thread of the worker's")
    g.add_argument("--kvstore-shared-memory-mib", type=int, default=d.kvstore_shared_memory_mib,
                   help="MiB of /dev/shm for block moves with kvstore nodes on this host (0 = gRPC only)")
    g.add_argument("--engine-shared-memory-mib", type=int, default=d.engine_shared_memory_mib,
                   help="MiB of /dev/shm for pages between the worker and its engine process (0 = pipes only)")
    return parser


def worker_fields_from_args(args: argparse.Namespace) -> dict:
    """Keyword arguments for a WorkerConfig subclass; bad values fail in its __post_init__."""
    nodes = tuple(a.strip() for item in (args.kvstore or ()) for a in item.split(",") if a.strip())
    return dict(engine=engine_config_from_args(args), kvstore=nodes, host=args.host, port=args.port,
                advertise_address=args.advertise_address, redis_url=args.redis_url,
                metrics_port=args.metrics_port, lease_seconds=args.lease_seconds,
                publish_interval=args.publish_interval, max_pending_requests=args.max_pending_requests,
                engine_process=args.engine_process, kvstore_shared_memory_mib=args.kvstore_shared_memory_mib,
                engine_shared_memory_mib=args.engine_shared_memory_mib)
