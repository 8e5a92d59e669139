"""Gateway configuration: one frozen, validated dataclass built from vLLM-style flags.

No torch: the gateway must start in a process that never imports it.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

from kvmesh.config import DEFAULT_MODEL
from kvmesh.kv.layout import KV_CACHE_DTYPES, canonical_kv_dtype


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    """--host: address the HTTP server binds."""
    port: int = 8000
    """--port: HTTP port (0 = pick a free one)."""
    model: str = DEFAULT_MODEL
    """--model: same value the workers get; the tokenizer, chat template and block hashes come from it."""
    served_model_name: tuple[str, ...] = ()
    """--served-model-name: names clients use in `model` (default: --model). The first is reported."""
    api_key: Optional[str] = None
    """--api-key: when set, every /v1 request needs `Authorization: Bearer <key>` (env KVMESH_API_KEY)."""
    prefill: tuple[str, ...] = ()
    """--prefill: host:port of a prefill worker (repeatable). None: decode workers prefill themselves."""
    decode: tuple[str, ...] = ()
    """--decode: host:port of a decode worker (repeatable; at least one)."""
    redis_url: Optional[str] = None
    """--redis-url: prefix index in Redis; default an in-memory index (only useful in one process)."""
    kv_cache_dtype: str = "auto"
    """--kv-cache-dtype: must equal the workers' flag (it is part of every block hash)."""
    block_size: int = 16
    """--block-size: must equal the workers' flag (it is part of every block hash)."""
    dtype: str = "auto"
    """--dtype: the workers' model dtype; with --kv-cache-dtype auto it names the KV dtype."""
    device: str = "auto"
    """--device: the workers' device; resolves --dtype auto as the engine does (cpu: fp32, cuda: bf16)."""
    max_model_len: Optional[int] = None
    """--max-model-len: longest prompt + output; default the model's context length."""
    prefill_threshold_tokens: int = 256
    """--prefill-threshold-tokens: an uncached tail up to this many tokens is prefilled by the decode worker."""
    route_alpha: float = 1.0
    """--route-alpha: cost per uncached prompt token."""
    route_beta: float = 512.0
    """--route-beta: cost per request in flight on a worker (in token units)."""
    route_store_weight: float = 0.1
    """--route-store-weight: cost of a token whose block only a kvstore holds, relative to an uncached one."""
    route_tolerance: float = 64.0
    """--route-tolerance: costs within this of the best are near-equal; pick among them by load, then at random."""
    max_num_requests: int = 256
    """--max-num-requests: concurrent requests the gateway admits; more get 429."""
    health_interval_s: float = 2.0
    """--health-interval: seconds between gRPC health checks of each worker."""
    request_timeout_s: float = 600.0
    """--request-timeout: seconds a single worker call may take."""
    stalled_stream_timeout_s: float = 10.0
    """--stalled-stream-timeout: a stream whose worker the health checks find down, that has sent
    nothing for this many seconds and cannot resume on another worker (dispatcher.py), is failed
    with an in-band error; without it, a hung worker's streams wait for gRPC's keepalive (~80 s)."""
    bulk_threads: int = 2
    """--bulk-threads: threads for inputs longer than any prompt the context holds (/tokenize and
    /detokenize of megabytes, bodies of 1 MB or more): such work queues on these, so a flood of it
    cannot take the threads that tokenize the prompts that fit (prompts.py)."""
    index_timeout_s: float = 1.0
    """--index-timeout: seconds a prefix-index lookup may take before the request routes as a miss
    (a lookup of a whole prompt is one Redis round trip, milliseconds; the slack is for a busy
    gateway's event loop, whose lag counts too: a timeout opens the breaker, index_breaker.py)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not self.decode:
            raise ValueError("--decode: give at least one decode worker address (host:port)")
        for flag, addrs in (("--prefill", self.prefill), ("--decode", self.decode)):
            for a in addrs:
                host, sep, port = a.rpartition(":")
                if not sep or not host or not port.isdigit():
                    raise ValueError(f"{flag} expects host:port, got {a!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.dtype not in ("auto", "fp32", "fp16", "bf16"):
            raise ValueError(f"--dtype must be auto, fp32, fp16 or bf16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.prefill_threshold_tokens < 0:
            raise ValueError(f"--prefill-threshold-tokens must be >= 0, got {self.prefill_threshold_tokens}")
        for flag, v in (("--route-alpha", self.route_alpha), ("--route-beta", self.route_beta),
                        ("--route-store-weight", self.route_store_weight),
                        ("--route-tolerance", self.route_tolerance)):
            if v < 0:
                raise ValueError(f"{flag} must be >= 0, got {v}")
        if self.max_num_requests < 1:
            raise ValueError(f"--max-num-requests must be >= 1, got {self.max_num_requests}")
        if self.health_interval_s <= 0:
            raise ValueError(f"--health-interval must be > 0, got {self.health_interval_s}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        if self.stalled_stream_timeout_s <= 0:
            raise ValueError(f"--stalled-stream-timeout must be > 0, got {self.stalled_stream_timeout_s}")
        if self.bulk_threads < 1:
            raise ValueError(f"--bulk-threads must be >= 1, got {self.bulk_threads}")
        if self.index_timeout_s <= 0:
            raise ValueError(f"--index-timeout must be > 0, got {self.index_timeout_s}")

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_model_name or (self.model,)

    def model_dtype(self) -> str:
        """The workers' resolved model dtype (the engine's rule: auto = fp32 on the CPU, bf16 on a GPU).

        With --device auto the gateway cannot see the workers' device; it assumes the CPU unless
        --dtype is given, so pass --dtype (or --device) when workers run on a GPU.
        """
        if self.dtype != "auto":
            return self.dtype
        return "bf16" if self.device == "cuda" else "fp32"

    def kv_dtype(self) -> str:
        """Canonical KV dtype that goes into block hashes."""
        return canonical_kv_dtype(self.kv_cache_dtype, self.model_dtype())


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = GatewayConfig.__dataclass_fields__
    p = parser
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default)
    p.add_argument("--model", default=d["model"].default)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY"))
    p.add_argument("--prefill", action="append", default=None, metavar="HOST:PORT")
    p.add_argument("--decode", action="append", default=None, metavar="HOST:PORT")
    p.add_argument("--redis-url", default=os.environ.get("KVMESH_REDIS_URL"))
    p.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"].default, choices=KV_CACHE_DTYPES)
    p.add_argument("--block-size", type=int, default=d["block_size"].default)
    p.add_argument("--dtype", default=d["dtype"].default)
    p.add_argument("--device", default=d["device"].default)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--prefill-threshold-tokens", type=int, default=d["prefill_threshold_tokens"].default)
    p.add_argument("--route-alpha", type=float, default=d["route_alpha"].default)
    p.add_argument("--route-beta", type=float, default=d["route_beta"].default)
    p.add_argument("--route-store-weight", type=float, default=d["route_store_weight"].default)
    p.add_argument("--route-tolerance", type=float, default=d["route_tolerance"].default)
    p.add_argument("--max-num-requests", type=int, default=d["max_num_requests"].default)
    p.add_argument("--health-interval", type=float, default=d["health_interval_s"].default)
    p.add_argument("--request-timeout", type=float, default=d["request_timeout_s"].default)
    p.add_argument("--stalled-stream-timeout", type=float, default=d["stalled_stream_timeout_s"].default)
    p.add_argument("--index-timeout", type=float, default=d["index_timeout_s"].default)
    p.add_argument("--bulk-threads", type=int, default=d["bulk_threads"].default)
    return parser


def from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host, port=args.port, model=args.model,
        served_model_name=tuple(args.served_model_name or ()), api_key=args.api_key or None,
        prefill=tuple(args.prefill or ()), decode=tuple(args.decode or ()), redis_url=args.redis_url,
        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size, dtype=args.dtype,
        device=args.device, max_model_len=args.max_model_len,
        prefill_threshold_tokens=args.prefill_threshold_tokens, route_alpha=args.route_alpha,
        route_beta=args.route_beta, route_store_weight=args.route_store_weight,
        route_tolerance=args.route_tolerance, max_num_requests=args.max_num_requests,
        health_interval_s=args.health_interval, request_timeout_s=args.request_timeout,
        stalled_stream_timeout_s=args.stalled_stream_timeout, index_timeout_s=args.index_timeout,
        bulk_threads=args.bulk_threads)
