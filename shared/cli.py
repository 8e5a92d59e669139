"""The `kvmesh` command: `up`, one service each (`gateway|prefill|decode|kvstore`), `memory`.

Each service subcommand takes its flags from its package's `config.py` (`add_cli_args(parser)`,
`from_args(args)`) and runs `serve(cfg)` under uvloop until SIGINT/SIGTERM. Every long flag can
also come from the environment as KVMESH_<FLAG> (`--kv-cache-dtype` <- KVMESH_KV_CACHE_DTYPE), which
is how docker compose and Kubernetes configure the roles; a flag on the command line wins.

Only the chosen subcommand's modules are imported, so `kvmesh memory` works without torch and
without the services.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Optional, Sequence

ENV_PREFIX = "KVMESH_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class ServiceEntry:
    """Where a role's config and `serve` live (imported only when the role runs)."""

    config_module: str
    server_module: str
    help: str


SERVICES: dict[str, ServiceEntry] = {
    "kvstore": ServiceEntry("kvmesh.kvstore.config", "kvmesh.kvstore.server", "content-addressed KV block store (gRPC)"),
    "prefill": ServiceEntry("kvmesh.prefill.config", "kvmesh.prefill.server", "prefill worker (gRPC)"),
    "decode": ServiceEntry("kvmesh.decode.config", "kvmesh.decode.server", "decode worker (gRPC)"),
    "gateway": ServiceEntry("kvmesh.gateway.config", "kvmesh.gateway.app", "OpenAI-compatible HTTP gateway"),
}
COMMANDS: dict[str, str] = {
    "up": "start every service as its own process on loopback",
    **{name: e.help for name, e in SERVICES.items()},
    "index": "serve an in-memory prefix index over HTTP (used by `kvmesh up` without --redis-url)",
    "memory": "KV bytes per token and what fits in a memory budget, per KV dtype",
    "health": "probe a service's gRPC health or HTTP /health (for container health checks)",
}


# ---------------------------------------------------------------------------------------------
# environment defaults
# ---------------------------------------------------------------------------------------------
def env_name(flag: str) -> str:
    """--kv-cache-dtype -> KVMESH_KV_CACHE_DTYPE"""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _parse_bool(text: str, where: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{where}: expected true/false (1/0, yes/no), got {text!r}")


def _convert(action: argparse.Action, text: str, where: str):
    conv = action.type or str
    try:
        value = conv(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"{where}: invalid value {text!r} ({e})") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: invalid choice {text!r} (choose from {', '.join(map(str, action.choices))})")
    return value


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Set each long flag's default from KVMESH_<FLAG> when that variable is set.

    Errors name both the variable and the flag, e.g. "KVMESH_PORT (--port): invalid value 'x'".
    """
    for action in parser._actions:  # argparse keeps no public list of actions
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        flag = longs[0]
        var = env_name(flag)
        if var not in environ:
            continue
        text = environ[var]
        where = f"{var} ({flag})"
        try:
            if isinstance(action, argparse.BooleanOptionalAction) or isinstance(action, argparse._StoreTrueAction):
                value = _parse_bool(text, where)
            elif isinstance(action, argparse._StoreFalseAction):
                value = not _parse_bool(text, where)
            elif isinstance(action, argparse._StoreConstAction):
                value = action.const if _parse_bool(text, where) else action.default
            elif isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
                value = [_convert(action, part.strip(), where) for part in text.split(",") if part.strip()]
            else:
                value = _convert(action, text, where)
        except ValueError as e:
            parser.error(str(e))
        action.default = value
        action.required = False


# ---------------------------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------------------------
def _add_common_service_args(p: argparse.ArgumentParser) -> None:
    """Flags every service role gets from the CLI (unless its own config already defines them)."""
    known = set(p._option_string_actions)
    if "--otlp-endpoint" not in known:
        p.add_argument("--otlp-endpoint", default=None,
                       help="OTLP gRPC endpoint for traces (e.g. http://jaeger:4317); "
                            "default $OTEL_EXPORTER_OTLP_ENDPOINT; unset = no tracing")
    if "--log-level" not in known:
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="logging level")
    p.add_argument("--loop-watch-seconds", type=float, default=1.0,
                   help="log the stack of a blocking call that holds the event loop this long (0: off)")


def _add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model dir, .gguf file or `smollm2`")
    p.add_argument("--layers", type=int, default=None, help="number of layers (instead of --model)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (instead of --model)")
    p.add_argument("--head-dim", type=int, default=None, help="head dimension (instead of --model)")
    p.add_argument("--memory", default="80GiB", help="memory for the KV cache, e.g. 80GiB, 40GB (default 80GiB)")
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length for the sequences column")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-dtype", action="append", default=None,
                   help="limit the report to these KV dtypes (repeatable; default all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_health_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="host:port (gRPC health) or http://host:port (GET /health)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")


def _add_index_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=50050, help="HTTP port")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _add_service_args(role: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        importlib.import_module(SERVICES[role].config_module).add_cli_args(p)
        _add_common_service_args(p)
    return add


def _add_up_args(p: argparse.ArgumentParser) -> None:
    from kvmesh.launcher import add_up_args
    add_up_args(p)


def build_parser(command: Optional[str], environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """A parser whose only populated subcommand is `command` (the others stay unimported)."""
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: disaggregated LLM serving over a "
                                     "quantized, paged, prefix-shared KV cache")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    adders: dict[str, Callable[[argparse.ArgumentParser], None]] = {
        "up": _add_up_args, "memory": _add_memory_args, "health": _add_health_args, "index": _add_index_args,
        **{role: _add_service_args(role) for role in SERVICES},
    }
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            adders[name](p)
            apply_env_defaults(p, environ)
    return parser


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------
def _setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


async def serve_until_signal(serve: Callable[[Callable[[], None]], Awaitable],
                             loop_watch_s: float = 1.0) -> None:
    """Run a service, `serve(on_ready)`, until it ends or SIGINT/SIGTERM arrives (then cancel it:
    graceful stop); SIGUSR1 prints where it waits (kvmesh.stack_dump); once it serves, a loop held
    by a blocking call is logged (kvmesh.loop_watch; its start-up, imports and models, is not: a
    cold start on a loaded machine held the loop over 1 s importing aiohttp)."""
    from kvmesh.loop_watch import LoopWatch
    from kvmesh.stack_dump import install_on_loop

    watch = LoopWatch(threshold_s=loop_watch_s) if loop_watch_s > 0 else None
    task = asyncio.ensure_future(serve(watch.start if watch is not None else lambda: None))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    install_on_loop(loop)  # kill -USR1: where every thread and task waits, on stderr
    try:
        await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
    finally:
        if watch is not None:
            await watch.stop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            loop.remove_signal_handler(sig)


ENGINE_ROLES = ("prefill", "decode")


def environ_for_engines(env) -> None:
    """An engine's torch threads sleep when they run out of work instead of spinning (OpenMP's
    active wait): where several engines share a machine's cores (`kvmesh up` starts one a worker,
    each in its own process), one engine's spinning threads starve the others. On the 2-core build
    machine, one prefill and two decode workers served the soak's mix at 5.8 requests/s with
    sleeping threads and 0.4 with OpenMP's default (docs/benchmarks.md, "Soak of the whole stack").
    A value already set wins."""
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _run_service(role: str, args: argparse.Namespace, parser: argparse.ArgumentParser, environ) -> int:
    import uvloop

    from kvmesh.telemetry import setup_tracing

    entry = SERVICES[role]
    if role in ENGINE_ROLES:  # before torch loads here or in the engine process (which inherits it)
        environ_for_engines(os.environ)
    try:
        cfg = importlib.import_module(entry.config_module).from_args(args)
    except ValueError as e:  # config validation names the flag
        parser.error(str(e))
    if args.loop_watch_seconds < 0:
        parser.error(f"--loop-watch-seconds must be >= 0, got {args.loop_watch_seconds}")
    _setup_logging(args.log_level, role)
    serve = importlib.import_module(entry.server_module).serve
    endpoint = args.otlp_endpoint or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    tracing = setup_tracing(f"kvmesh-{role}", endpoint)
    try:
        uvloop.run(serve_until_signal(lambda on_ready: serve(cfg, on_ready), args.loop_watch_seconds))
    finally:
        tracing.shutdown()
    return 0


def _run_memory(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvmesh.memory_report import REPORT_DTYPES, ModelShape, build_report, parse_bytes, shape_from_model
    from kvmesh.kv.layout import canonical_kv_dtype

    manual = (args.layers, args.kv_heads, args.head_dim)
    try:
        if args.model is not None:
            if any(v is not None for v in manual):
                parser.error("--model and --layers/--kv-heads/--head-dim are exclusive; give one or the other")
            shape = shape_from_model(args.model)
        else:
            missing = [f for f, v in zip(("--layers", "--kv-heads", "--head-dim"), manual) if v is None]
            if missing:
                parser.error(f"give --model, or all of --layers --kv-heads --head-dim (missing {' '.join(missing)})")
            shape = ModelShape(*manual)
        dtypes = REPORT_DTYPES
        if args.kv_cache_dtype:
            dtypes = tuple(dict.fromkeys(canonical_kv_dtype(d, "fp16") for d in args.kv_cache_dtype))
        report = build_report(shape, parse_bytes(args.memory), args.seq_len, args.block_size, dtypes)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    print(report.to_json() if args.json else report.to_text())
    return 0


def _run_health(args: argparse.Namespace) -> int:
    from kvmesh.launcher import probe

    ok, detail = probe(args.target, args.timeout)
    print(f"{args.target}: {detail}")
    return 0 if ok else 1


def _run_index(args: argparse.Namespace) -> int:
    import uvloop

    from kvmesh.remote_index import serve_index

    _setup_logging(args.log_level, "index")
    uvloop.run(serve_until_signal(lambda on_ready: serve_index(args.host, args.port, on_ready)))
    return 0


def _run_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvmesh.launcher import StackConfig, run_stack

    try:
        cfg = StackConfig.from_args(args)
    except ValueError as e:
        parser.error(str(e))
    return run_stack(cfg)


def main(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    command = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(command, environ)
    args = parser.parse_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # the subcommand's own parser
    if args.command in SERVICES:
        return _run_service(args.command, args, sub, environ)
    if args.command == "memory":
        return _run_memory(args, sub)
    if args.command == "health":
        return _run_health(args)
    if args.command == "index":
        return _run_index(args)
    return _run_up(args, sub)


if __name__ == "__main__":
    sys.exit(main())
