"""The long soak: `kvmesh up` under concurrent clients for minutes (tests/soak.py's mix: well-formed
requests through the openai client, abandoned streams, fuzzed bodies), then the same checks as the
CI's short soak (tests/test_soak.py), and a table of what each kind of request got.

    .venv/bin/python benchmarks/soak.py [--seconds 300] [--clients 12] [--kv-cache-dtype auto,int4]
        [--num-prefill 1] [--num-decode 2] [--num-kvstore 1] [--engine-process on] [--kv-cache-memory 48MiB]
        [--seed 0] [--device cpu] [--loop-watch-seconds 1]

A stack per --kv-cache-dtype value, one after the other; its services' output goes to
/tmp/kvmesh-soak-DTYPE.log (an ERROR line or a traceback there is a problem too). Exits 1 if any rule broke (the problems
listed), so a long run can gate a release.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from soak import SoakConfig, check_quiet, greedy_answer, run_soak, table  # noqa: E402
from test_soak import MAX_MODEL_LEN, logged_errors, probes, segments_of, soak_stack_config, stack_pids  # noqa: E402

from kvmesh.launcher import Stack  # noqa: E402


def one_stack(args: argparse.Namespace, kv_dtype: str) -> list[str]:
    cfg = soak_stack_config(kv_dtype, args.kv_cache_memory)
    where = () if args.engine_process == "on" else ("--no-engine-process",)
    watch = ("--loop-watch-seconds", str(args.loop_watch_seconds))
    extra = (("prefill", where + watch), ("decode", where + watch), ("kvstore", watch), ("gateway", watch))
    cfg = dataclasses.replace(cfg, num_prefill=args.num_prefill, num_decode=args.num_decode,
                              num_kvstore=args.num_kvstore, extra_args=extra,
                              engine_flags=cfg.engine_flags + (("--device", args.device) if args.device else ()))
    problems: list[str] = []
    started = time.monotonic()
    log = f"/tmp/kvmesh-soak-{kv_dtype}.log"
    with open(log, "w") as out, Stack(cfg, log=out) as stack:
        print(f"\n## kv-cache-dtype {kv_dtype}: stack up in {time.monotonic() - started:.0f} s, "
              f"{args.num_prefill} prefill / {args.num_decode} decode workers, {args.num_kvstore} kvstores, "
              f"engine process {args.engine_process}", flush=True)
        reference = asyncio.run(greedy_answer(stack.url, "smollm2"))
        report = asyncio.run(run_soak(stack.url, "smollm2", SoakConfig(
            seconds=args.seconds, clients=args.clients, seed=args.seed, max_model_len=MAX_MODEL_LEN)))
        total = sum(report.counts.values())
        print(table(report))
        print(f"{total} requests in {report.seconds:.0f} s ({total / report.seconds:.1f} a second), "
              f"{args.clients} clients")
        problems += report.problems
        problems += asyncio.run(check_quiet(probes(stack)))
        if asyncio.run(greedy_answer(stack.url, "smollm2")) != reference:
            problems.append("the greedy answer after the load differs from the one before it")
        problems += [f"{c.name} died" for c in stack.children if c.popen.poll() is not None]
        problems += [f"logged: {line}" for line in logged_errors(log)]
        pids = stack_pids(stack)
    leaked = segments_of(pids)
    if leaked:
        problems.append(f"shared-memory segments left behind: {sorted(leaked)}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--kv-cache-dtype", default="auto,int4", help="a stack for each, e.g. auto,fp8,int8,int4")
    ap.add_argument("--num-prefill", type=int, default=1)
    ap.add_argument("--num-decode", type=int, default=2)
    ap.add_argument("--num-kvstore", type=int, default=1)
    ap.add_argument("--engine-process", default="on", choices=["on", "off"],
                    help="the workers' engines in processes of their own (on, as shipped) or on a thread")
    ap.add_argument("--kv-cache-memory", default="48MiB", help="each worker's KV pool (small: bursts preempt)")
    ap.add_argument("--device", default="", help="the workers' --device (default: theirs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loop-watch-seconds", type=float, default=1.0,
                    help="every service logs (a problem here) a blocking call that holds its loop this long")
    args = ap.parse_args()
    problems = []
    for kv_dtype in args.kv_cache_dtype.split(","):
        problems += [f"[{kv_dtype}] {p}" for p in one_stack(args, kv_dtype)]
    print("\nproblems:" if problems else "\nno problems", *problems, sep="\n  ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
