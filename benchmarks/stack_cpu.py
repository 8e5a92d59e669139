"""Where a served token's CPU goes: every process (and thread) of a `kvmesh up` stack over one burst.

    python3 benchmarks/stack_cpu.py [--model smollm2] [--kv-cache-dtype int4] [--num-prefill 0]
        [--requests 256] [--prompt-len 1024] [--new-tokens 128] [--max-chunk-rate 5000] [--device cuda]
        [--no-engine-process]

Starts the stack, sends one warm-up burst, then a burst of streamed `/v1/completions` (the client
of `serving.py`, in this process) and reads each child's per-thread CPU time from /proc before and
after: µs of CPU per generated token and cores busy, per process, with its busiest threads ("main"
is the thread that runs the service's event loop; Python threads show as the interpreter's name,
grpc's as event_engine; a worker's engine process, its child, is a row of its own). Linux only. A tiny model (`--model DIR --token-range 3,250`, the tests'
`make_tiny_model`) makes the engine's own share small, so the services' cost stands out.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time

import gpu_serving as gs  # benchmarks/gpu_serving.py: the load; kvmesh importable
import serving as sv  # benchmarks/serving.py: the client, the engine flags

from kvmesh.launcher import Stack, StackConfig  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[tuple[str, str], float]:
    """{(thread id, name): CPU seconds} of one process."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
        except OSError:  # the thread ended
            continue
        fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
        out[(tid, "main" if tid == str(pid) else name)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a worker's engine process)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()
                cmd = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if int(fields[1]) == pid and b"resource_tracker" not in cmd:  # multiprocessing's helper
                out.append(int(entry))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("KVMESH_SMOLLM2_GGUF", "smollm2"))
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--kv-cache-dtype", default="int4")
    ap.add_argument("--num-prefill", type=int, default=0)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--spread", type=float, default=0.75)
    ap.add_argument("--token-range", default="100,30000")
    ap.add_argument("--max-chunk-rate", default="5000")
    ap.add_argument("--kv-memory-mib", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                    help="the workers' engines in processes of their own (default) or in a thread of theirs")
    a = ap.parse_args()
    ids = range(*map(int, a.token_range.split(",")))
    load = gs.make_load(a.requests, a.prompt_len, a.new_tokens, a.spread, seed=5, ids=ids)
    longest = max(len(p) + n for p, n in zip(load.prompts, load.new_tokens))
    where = "--engine-process" if a.engine_process else "--no-engine-process"
    cfg = StackConfig(model=a.model, kv_cache_dtype=a.kv_cache_dtype, port=0, num_prefill=a.num_prefill,
                      engine_flags=sv.engine_flags(a, longest), log_level="warning",
                      extra_args=(("decode", ("--max-chunk-rate", a.max_chunk_rate, where)), ("prefill", (where,))))
    stack = Stack(cfg).start()
    try:
        mid = asyncio.run(sv._model_id(stack.url))
        asyncio.run(sv._streams(stack.url, mid, gs.make_load(16, a.prompt_len, 16, a.spread, ids=ids), 0, 0))
        pids = {c.name: c.pid for c in stack.children}
        pids.update({f"{c.name} engine": p for c in stack.children for p in child_pids(c.pid)})
        before = {name: thread_cpu(pid) for name, pid in pids.items()}
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        streams = asyncio.run(sv._streams(stack.url, mid, load, 0, 0))
        wall, r1 = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_SELF)
        after = {name: thread_cpu(pid) for name, pid in pids.items()}
    finally:
        stack.stop()
    row = sv.served_row(wall, streams, load)
    tokens = sum(load.new_tokens)
    print(f"{os.path.basename(a.model)} {a.kv_cache_dtype}, {a.requests} requests, --num-prefill {a.num_prefill}, "
          f"--max-chunk-rate {a.max_chunk_rate}, {where}: {row['tokens_s']:.0f} tokens/s, {row['tokens_a_chunk']:.2f} "
          f"tokens a chunk\n")
    print("| process | µs CPU a token | cores busy | busiest threads (µs a token) |\n|---|---|---|---|")
    client = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    print(f"| client (this process) | {client / tokens * 1e6:.1f} | {client / wall:.2f} | |")
    for name in pids:
        by_name: dict[str, float] = {}
        for (tid, thread), t in after[name].items():
            by_name[thread] = by_name.get(thread, 0.0) + t - before[name].get((tid, thread), 0.0)
        total = sum(by_name.values())
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:3]
        print(f"| {name} | {total / tokens * 1e6:.1f} | {total / wall:.2f} | "
              + ", ".join(f"{k} {v / tokens * 1e6:.1f}" for k, v in top) + " |")


if __name__ == "__main__":
    main()
