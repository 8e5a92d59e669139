"""`kvmesh up`: every service as its own OS process on loopback, supervised from one terminal.

Start order: the prefix index and the kvstore node(s) first, then the prefill and decode workers
(they load the model in parallel), then the gateway; each waits for the one before it to answer its
health check (gRPC health for the gRPC services, GET /health for the HTTP ones). Stop order is the
reverse, SIGTERM then SIGKILL after a grace period (kvmesh.supervisor runs the child processes). A
child that exits on its own stops the rest with a message naming it; with --restart it is started
again instead (the others ride out its absence: docs/kvstore.md, tests/test_outages.py), unless it
keeps dying, and one that stops answering health checks is killed first.

Without --redis-url the prefix index is one `MemoryIndex` served by a `kvmesh index` child over HTTP
(see kvmesh.remote_index); every service gets its URL as --redis-url, since `make_index` maps an
http:// URL to a `RemoteIndex`. With --redis-url they all use Redis directly.

`Stack(cfg).start()` / `.stop()` is the same thing for tests.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, TextIO

from kvmesh.config import DEFAULT_MODEL
from kvmesh.kv.layout import KV_CACHE_DTYPES
from kvmesh.supervisor import ServiceProcess, StackError, Supervisor, free_port, probe

__all__ = ["Stack", "StackConfig", "StackError", "add_up_args", "free_port", "probe", "run_stack"]

ROLES_IN_START_ORDER = (("index", "kvstore"), ("prefill", "decode"), ("gateway",))
# Stop ranks, lowest first: the reverse of ROLES_IN_START_ORDER (the gateway stops taking requests first).
STOP_ORDER = {"gateway": 0, "prefill": 1, "decode": 1, "kvstore": 2, "index": 3}
RESTARTS_PER_WINDOW = 5  # --restart: more deaths than this in the window is a crash loop; the stack stops
RESTART_WINDOW_S = 300.0
LIVENESS_INTERVAL_S = 5.0  # --restart: every service that has answered once is probed this often
LIVENESS_MISSES = 4  # and killed (then started again) after more probes than this unanswered in a row


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StackConfig:
    model: str = DEFAULT_MODEL
    """--model: passed to the workers and the gateway."""
    kv_cache_dtype: str = "auto"
    """--kv-cache-dtype"""
    block_size: int = 16
    """--block-size"""
    engine_flags: tuple[str, ...] = ()
    """Other engine flags passed to prefill, decode and (where it knows them) the gateway:
    --dtype --device --max-num-seqs --max-num-batched-tokens --max-model-len --kv-cache-memory ..."""
    redis_url: Optional[str] = None
    """--redis-url: prefix index in Redis; none = one in-memory index process."""
    host: str = "127.0.0.1"
    """--host: address the gateway binds (the other services always bind loopback)."""
    port: int = 8000
    """--port: the gateway's HTTP port (0 = a free one)."""
    api_key: Optional[str] = None
    """--api-key: Bearer key the gateway requires."""
    num_prefill: int = 1
    """--num-prefill: prefill workers (0: decode workers prefill themselves)."""
    num_decode: int = 1
    """--num-decode: decode workers."""
    num_kvstore: int = 1
    """--num-kvstore: kvstore nodes (blocks shard over them by rendezvous hashing)."""
    kvstore_capacity_bytes: Optional[int] = None
    """--kvstore-capacity-bytes: each kvstore node's pool size."""
    otlp_endpoint: Optional[str] = None
    """--otlp-endpoint: OTLP gRPC endpoint every service sends traces to."""
    restart: bool = False
    """--restart: a service that dies, or hangs (no answer to a health check for
    LIVENESS_MISSES x LIVENESS_INTERVAL_S, once it had answered), is started again with the same
    command line (at most `RESTARTS_PER_WINDOW` times in `RESTART_WINDOW_S` each), instead of
    stopping the stack."""
    metrics: bool = False
    """--metrics: every kvstore and worker serves Prometheus /metrics too, each on a free port
    (`Stack.metrics_urls`, listed when the stack is up); the gateway always does."""
    log_level: str = "info"
    """--log-level of every service."""
    startup_timeout_s: float = 600.0
    """--startup-timeout: seconds each service may take to become healthy (model loading included)."""
    extra_args: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """--kvstore-args/--prefill-args/--decode-args/--gateway-args: more flags for one role."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.num_prefill < 0:
            raise ValueError(f"--num-prefill must be >= 0, got {self.num_prefill}")
        for flag, n in (("--num-decode", self.num_decode), ("--num-kvstore", self.num_kvstore)):
            if n < 1:
                raise ValueError(f"{flag} must be >= 1, got {n}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis-url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"--startup-timeout must be positive, got {self.startup_timeout_s}")

    def extra(self, role: str) -> tuple[str, ...]:
        return dict(self.extra_args).get(role, ())

    @staticmethod
    def from_args(args: argparse.Namespace) -> "StackConfig":
        engine: list[str] = []
        for flag in _ENGINE_PASSTHROUGH:
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is not None:
                engine += [flag, str(value)]
        if getattr(args, "enforce_eager", False):
            engine.append("--enforce-eager")
        if args.enable_prefix_caching is not None:
            engine.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
        for name in ("async_scheduling", "fuse_norm_linears"):  # on/off flags left to the workers' default
            value = getattr(args, name, None)
            if value is not None:
                engine.append(("--" if value else "--no-") + name.replace("_", "-"))
        extra = tuple((role, tuple(shlex.split(getattr(args, f"{role}_args") or "")))
                      for role in ("kvstore", "prefill", "decode", "gateway"))
        return StackConfig(
            model=args.model, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
            engine_flags=tuple(engine), redis_url=args.redis_url or None, host=args.host, port=args.port,
            api_key=args.api_key or None, num_prefill=args.num_prefill, num_decode=args.num_decode,
            num_kvstore=args.num_kvstore, kvstore_capacity_bytes=args.kvstore_capacity_bytes,
            otlp_endpoint=args.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
            metrics=args.metrics, restart=args.restart,
            log_level=args.log_level, startup_timeout_s=args.startup_timeout, extra_args=extra)


_ENGINE_PASSTHROUGH = ("--dtype", "--device", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                       "--kv-cache-memory", "--gpu-memory-utilization", "--attention-backend", "--seed",
                       "--max-seq-len-to-capture")


def add_up_args(p: argparse.ArgumentParser) -> None:
    d = StackConfig()
    p.add_argument("--model", default=d.model, help="HF model dir, .gguf file or `smollm2` (default)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--dtype", default=None, choices=["auto", "fp32", "fp16", "bf16"])
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None, help="workers' KV pool size, e.g. 2GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton"])
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="workers run decode steps without CUDA graphs")
    p.add_argument("--max-seq-len-to-capture", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="workers launch each step before the last one's tokens are read back (default: on a GPU)")
    p.add_argument("--fuse-norm-linears", action=argparse.BooleanOptionalAction, default=None,
                   help="workers on a GPU run RMSNorm, the GEMM and RoPE / SiLU as one kernel (default: off)")
    p.add_argument("--redis-url", default=None, help="prefix index in Redis; default one in-memory index process")
    p.add_argument("--host", default=d.host, help="address the gateway binds")
    p.add_argument("--port", type=int, default=d.port, help="gateway HTTP port (0 = any free port)")
    p.add_argument("--api-key", default=None, help="Bearer key the gateway requires")
    p.add_argument("--num-prefill", type=int, default=d.num_prefill, help="prefill workers (0 = none)")
    p.add_argument("--num-decode", type=int, default=d.num_decode, help="decode workers")
    p.add_argument("--num-kvstore", type=int, default=d.num_kvstore, help="kvstore nodes")
    p.add_argument("--kvstore-capacity-bytes", type=int, default=None, help="each kvstore node's pool bytes")
    p.add_argument("--otlp-endpoint", default=None, help="OTLP gRPC endpoint for every service's traces")
    p.add_argument("--metrics", action="store_true",
                   help="kvstores and workers serve Prometheus /metrics too, each on a free port (listed at start)")
    p.add_argument("--restart", action="store_true",
                   help="a service that dies, or hangs for 20 s, is started again (the others ride out its "
                        "absence) instead of stopping the stack; at most "
                        f"{RESTARTS_PER_WINDOW} times in {RESTART_WINDOW_S:g} s each")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout_s,
                   help="seconds each service may take to become healthy")
    for role in ("kvstore", "prefill", "decode", "gateway"):
        p.add_argument(f"--{role}-args", default=None, metavar="'FLAGS'",
                       help=f"more flags for every {role} process, one shell-quoted string")


# ---------------------------------------------------------------------------------------------
# the stack
# ---------------------------------------------------------------------------------------------
class Stack:
    """The whole kvmesh stack as child processes. `with Stack(cfg) as s: s.url ...` or start()/stop()."""

    def __init__(self, cfg: StackConfig, log: Optional[TextIO] = None) -> None:
        self.cfg = cfg
        self.log = log
        self.supervisor = Supervisor(log)
        self._ports: set[int] = set()  # picked for children that have not bound them yet
        self.gateway_port = cfg.port or self._free_port()
        self.index_url = cfg.redis_url
        self.metrics_urls: dict[str, str] = {}  # service name -> its /metrics (the gateway's always)
        self._restarts: dict[str, list[float]] = {}  # service name -> when --restart started it again
        self._abort = threading.Event()

    @property
    def children(self) -> list[ServiceProcess]:
        return self.supervisor.children

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::", "") else self.cfg.host
        return f"http://{host}:{self.gateway_port}"

    def _free_port(self) -> int:
        port = free_port(taken=self._ports)
        self._ports.add(port)
        return port

    # -- building the command lines ---------------------------------------------------------------
    def _base(self, role: str) -> list[str]:
        argv = [sys.executable, "-m", "kvmesh", role]
        if role != "index":
            argv += ["--log-level", self.cfg.log_level]
            if self.cfg.otlp_endpoint:
                argv += ["--otlp-endpoint", self.cfg.otlp_endpoint]
        return argv

    def _metrics(self, name: str) -> list[str]:
        """--metrics-port for service `name` when the stack exports every service's metrics."""
        if not self.cfg.metrics:
            return []
        port = self._free_port()
        self.metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
        return ["--metrics-port", str(port)]

    def _plan(self) -> list[list[ServiceProcess]]:
        cfg, lo = self.cfg, "127.0.0.1"
        waves: list[list[ServiceProcess]] = [[], [], []]
        if not cfg.redis_url:
            port = self._free_port()
            self.index_url = f"http://{lo}:{port}"
            waves[0].append(ServiceProcess("index", "index", self._base("index") + ["--host", lo, "--port", str(port)],
                                           self.index_url))
        kv_addrs = []
        for i in range(cfg.num_kvstore):
            port = self._free_port()
            kv_addrs.append(f"{lo}:{port}")
            argv = self._base("kvstore") + ["--host", lo, "--port", str(port), "--redis-url", self.index_url]
            if cfg.kvstore_capacity_bytes:
                argv += ["--capacity-bytes", str(cfg.kvstore_capacity_bytes)]
            argv += self._metrics(f"kvstore-{i}")
            waves[0].append(ServiceProcess(f"kvstore-{i}", "kvstore", argv + list(cfg.extra("kvstore")), kv_addrs[-1]))
        engine = ["--model", cfg.model, "--kv-cache-dtype", cfg.kv_cache_dtype, "--block-size", str(cfg.block_size),
                  *cfg.engine_flags]
        workers: dict[str, list[str]] = {"prefill": [], "decode": []}
        for role, n in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode)):
            for i in range(n):
                port = self._free_port()
                workers[role].append(f"{lo}:{port}")
                argv = self._base(role) + engine + ["--host", lo, "--port", str(port), "--redis-url", self.index_url]
                for a in kv_addrs:
                    argv += ["--kvstore", a]
                argv += self._metrics(f"{role}-{i}")
                waves[1].append(ServiceProcess(f"{role}-{i}", role, argv + list(cfg.extra(role)), workers[role][-1]))
        argv = self._base("gateway") + _known_flags("gateway", engine) + [
            "--host", cfg.host, "--port", str(self.gateway_port), "--redis-url", self.index_url]
        for role in ("prefill", "decode"):
            for a in workers[role]:
                argv += [f"--{role}", a]
        if cfg.api_key:
            argv += ["--api-key", cfg.api_key]
        host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        waves[2].append(ServiceProcess("gateway", "gateway", argv + list(cfg.extra("gateway")),
                                       f"http://{host}:{self.gateway_port}"))
        self.metrics_urls["gateway"] = f"http://{host}:{self.gateway_port}/metrics"
        return waves

    # -- running ---------------------------------------------------------------------------------
    def dead(self) -> Optional[ServiceProcess]:
        """The first child that has exited, if any."""
        return self.supervisor.dead()

    def _died_message(self, proc: ServiceProcess) -> str:
        return self.supervisor.died_message(proc)

    def start(self) -> "Stack":
        """Start every service, waiting for each wave to be healthy. Raises StackError (children stopped)."""
        try:
            for wave in self._plan():
                for proc in wave:
                    self.supervisor.spawn(proc)
                self.supervisor.wait_healthy(wave, self.cfg.startup_timeout_s, self._abort)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, dead: ServiceProcess) -> bool:
        """Start `dead` again with its command line (its port too), unless it died
        RESTARTS_PER_WINDOW times in the last RESTART_WINDOW_S (a crash loop: False)."""
        now = time.monotonic()
        recent = [t for t in self._restarts.get(dead.name, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= RESTARTS_PER_WINDOW:
            return False
        self._restarts[dead.name] = recent + [now]
        self.supervisor.emit(dead, f"exited with code {dead.returncode()}; starting it again "
                                   f"({len(recent) + 1} of {RESTARTS_PER_WINDOW} in {RESTART_WINDOW_S:g} s)")
        self.supervisor.respawn(dead)
        return True

    def interrupt(self) -> None:
        """Abort a start() in progress (from a signal handler or another thread)."""
        self._abort.set()

    def stop(self, grace_s: float = 15.0) -> dict[str, Optional[int]]:
        """SIGTERM the services in reverse start order, SIGKILL what outlives `grace_s`; their exit codes."""
        return self.supervisor.stop(STOP_ORDER, grace_s)

    def kill(self) -> None:
        """SIGKILL every child still running (a second Ctrl-C)."""
        self.supervisor.kill()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _known_flags(role: str, flags: list[str]) -> list[str]:
    """The (flag, value) pairs of `flags` that `kvmesh <role>` accepts (the gateway takes few engine flags)."""
    from kvmesh.cli import build_parser

    parser = build_parser(role, {})
    accepted = set(parser._subparsers._group_actions[0].choices[role]._option_string_actions)
    out, i = [], 0
    while i < len(flags):
        flag = flags[i]
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flag in accepted:
            out += flags[i:i + 2] if takes_value else [flag]
        i += 2 if takes_value else 1
    return out


def run_stack(cfg: StackConfig, out: TextIO = sys.stdout) -> int:
    """`kvmesh up`: start, print the URL, supervise until Ctrl-C / SIGTERM or a child dies."""
    stack = Stack(cfg, log=out)
    stop = threading.Event()

    def on_signal(signum, _frame):
        if stop.is_set():  # a second Ctrl-C: do not wait for graceful shutdowns
            print("\nkvmesh up: killing every service", file=out, flush=True)
            stack.kill()
        stop.set()
        stack.interrupt()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            stack.start()
        except StackError as e:
            if stop.is_set():
                print("\nkvmesh up: interrupted during startup; services stopped", file=out, flush=True)
                return 0
            print(f"\nkvmesh up: {e}", file=out, flush=True)
            return 1
        index = cfg.redis_url or f"in-memory ({stack.index_url})"
        print(f"\nkvmesh is up: {stack.url}/v1  (model {cfg.model}, kv cache {cfg.kv_cache_dtype}, "
              f"index {index})\n  try: curl {stack.url}/v1/models\n  Ctrl-C stops every service.",
              file=out, flush=True)
        if cfg.metrics:
            print("  metrics: " + ", ".join(f"{name} {url}" for name, url in stack.metrics_urls.items()),
                  file=out, flush=True)
        next_probe = time.monotonic() + LIVENESS_INTERVAL_S
        while not stop.wait(0.5):
            if cfg.restart and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + LIVENESS_INTERVAL_S
                hung = stack.supervisor.unresponsive(LIVENESS_MISSES)
                if hung is not None:
                    print(f"\nkvmesh up: {hung.name} (pid {hung.pid}) answered no health check for "
                          f"{LIVENESS_MISSES * LIVENESS_INTERVAL_S:g}+ s; killing it to start it again",
                          file=out, flush=True)
                    hung.popen.kill()
                    hung.popen.wait()
            dead = stack.dead()
            if dead is not None and cfg.restart and stack.restart(dead):
                continue
            if dead is not None:
                print(f"\nkvmesh up: {stack._died_message(dead)}", file=out, flush=True)
                stack.stop()
                return 1
        print("\nkvmesh up: stopping ...", file=out, flush=True)
        codes = stack.stop()
        print("kvmesh up: stopped (" + ", ".join(f"{k} {v}" for k, v in codes.items()) + ")", file=out, flush=True)
        return 0
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
