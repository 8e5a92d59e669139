"""kvstore configuration: one frozen, validated dataclass; flags named after the fields."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Literal, Optional

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class KVStoreConfig:
    host: str = "127.0.0.1"
    """--host: address to bind (0.0.0.0 for every interface)."""
    port: int = 50061
    """--port: gRPC port (0: any free port)."""
    capacity_bytes: int = 1 * GiB
    """--capacity-bytes: size of the block pool (GPU memory when present, host memory otherwise)."""
    capacity_blocks: Optional[int] = None
    """--capacity-blocks: pool size in blocks; needs --block-bytes; overrides --capacity-bytes."""
    block_bytes: Optional[int] = None
    """--block-bytes: bytes of one block slot; default the size of the first block put."""
    host_tier_bytes: int = 0
    """--host-tier-bytes: host-memory tier under the pool (evicted blocks demote there); 0 = off."""
    high_watermark: float = 0.95
    """--high-watermark: fraction of the pool in use that starts LRU eviction."""
    low_watermark: float = 0.85
    """--low-watermark: fraction of the pool eviction brings usage down to."""
    lease_seconds: float = 60.0
    """--lease-seconds: longest lease a reader may hold; a dead holder's blocks free within this."""
    redis_url: Optional[str] = None
    """--redis-url: publish held blocks to this Redis index; none = an in-process memory index."""
    advertise_address: Optional[str] = None
    """--advertise-address: host:port other services reach this node at (the index's holder name)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """--device: where the pool lives; auto = cuda when available."""
    chunk_bytes: int = 1 * MiB
    """--chunk-bytes: data bytes per stream message."""
    publish_interval: float = 0.05
    """--publish-interval: seconds between batched index updates."""
    put_yield_seconds: float = 0.0
    """--put-yield-seconds: pulls before pushes: every few blocks a put call waits up to this long
    for the gets in progress to finish (PullGate); 0 = calls take turns in arrival order."""
    metrics_port: Optional[int] = None
    """--metrics-port: serve Prometheus GET /metrics on this port (0: any free port); none = off."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.capacity_bytes <= 0:
            raise ValueError(f"--capacity-bytes must be positive, got {self.capacity_bytes}")
        if self.capacity_blocks is not None:
            if self.capacity_blocks <= 0:
                raise ValueError(f"--capacity-blocks must be positive, got {self.capacity_blocks}")
            if self.block_bytes is None:
                raise ValueError("--capacity-blocks needs --block-bytes (the size of one block slot)")
        if self.block_bytes is not None and self.block_bytes <= 0:
            raise ValueError(f"--block-bytes must be positive, got {self.block_bytes}")
        if self.block_bytes is not None and self.capacity_blocks is None and self.block_bytes > self.capacity_bytes:
            raise ValueError(f"--capacity-bytes ({self.capacity_bytes}) must hold at least one "
                             f"--block-bytes ({self.block_bytes}) block")
        if self.host_tier_bytes < 0:
            raise ValueError(f"--host-tier-bytes must be >= 0, got {self.host_tier_bytes}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"--high-watermark must be in (0, 1], got {self.high_watermark}")
        if not 0.0 <= self.low_watermark <= self.high_watermark:
            raise ValueError(f"--low-watermark must be in [0, --high-watermark={self.high_watermark}], "
                             f"got {self.low_watermark}")
        if self.lease_seconds <= 0:
            raise ValueError(f"--lease-seconds must be positive, got {self.lease_seconds}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"--chunk-bytes must be >= 4096, got {self.chunk_bytes}")
        if self.publish_interval <= 0:
            raise ValueError(f"--publish-interval must be positive, got {self.publish_interval}")
        if self.put_yield_seconds < 0:
            raise ValueError(f"--put-yield-seconds must be >= 0, got {self.put_yield_seconds}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://", "http://", "https://")):
            raise ValueError("--redis-url must start with redis://, rediss://, unix:// (Redis) or http(s):// "
                             f"(a `kvmesh index` process), got {self.redis_url!r}")

    @property
    def holder(self) -> str:
        """The name this node publishes in the index: the advertised address or host:port."""
        if self.advertise_address:
            return self.advertise_address
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """kvstore flags; KVMESH_REDIS_URL and KVMESH_ADVERTISE_ADDRESS supply defaults (compose, k8s)."""
    d = KVStoreConfig()
    add = parser.add_argument
    add("--host", default=d.host, help="address to bind (0.0.0.0: every interface)")
    add("--port", type=int, default=d.port, help="gRPC port (0: any free port)")
    add("--capacity-bytes", type=int, default=d.capacity_bytes,
        help="pool size in bytes (GPU memory when present, host memory otherwise)")
    add("--capacity-blocks", type=int, default=None, help="pool size in blocks (needs --block-bytes)")
    add("--block-bytes", type=int, default=None, help="bytes of one block slot (default: the first block's size)")
    add("--host-tier-bytes", type=int, default=d.host_tier_bytes,
        help="host-memory tier below the pool; evicted blocks demote there (0: off)")
    add("--high-watermark", type=float, default=d.high_watermark, help="pool fraction that starts LRU eviction")
    add("--low-watermark", type=float, default=d.low_watermark, help="pool fraction eviction brings usage down to")
    add("--lease-seconds", type=float, default=d.lease_seconds, help="longest lease a reader may hold")
    add("--redis-url", default=os.environ.get("KVMESH_REDIS_URL") or None,
        help="prefix index: redis://... or http://... of `kvmesh index` (default: in-process)")
    add("--advertise-address", default=os.environ.get("KVMESH_ADVERTISE_ADDRESS") or None,
        help="host:port others reach this node at; its name in the index (default: host:port)")
    add("--device", choices=["auto", "cpu", "cuda"], default=d.device, help="where the pool lives")
    add("--chunk-bytes", type=int, default=d.chunk_bytes, help="data bytes per stream message")
    add("--publish-interval", type=float, default=d.publish_interval, help="seconds between index updates")
    add("--put-yield-seconds", type=float, default=d.put_yield_seconds,
        help="pulls first: a put call waits up to this long, every few blocks, for gets in progress (0: off)")
    add("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (default: off)")
    return parser


def from_args(args: argparse.Namespace) -> KVStoreConfig:
    return KVStoreConfig(
        host=args.host, port=args.port, capacity_bytes=args.capacity_bytes,
        capacity_blocks=args.capacity_blocks, block_bytes=args.block_bytes,
        host_tier_bytes=args.host_tier_bytes, high_watermark=args.high_watermark,
        low_watermark=args.low_watermark, lease_seconds=args.lease_seconds, redis_url=args.redis_url,
        advertise_address=args.advertise_address, device=args.device, chunk_bytes=args.chunk_bytes,
        publish_interval=args.publish_interval, put_yield_seconds=args.put_yield_seconds,
        metrics_port=args.metrics_port)
