"""The short soak (CI): `kvmesh up` as shipped (index, kvstore, prefill and decode workers with their
engine processes, gateway; SmolLM2) under concurrent clients for half a minute: well-formed requests
through the official openai client, abandoned streams, fuzzed bodies. Every request keeps its rules
and afterwards nothing is held anywhere (tests/soak.py). The long variant is benchmarks/soak.py."""
from __future__ import annotations

import asyncio
import os

import pytest

from kvmesh.launcher import Stack, StackConfig
from soak import QuietProbes, SoakConfig, check_quiet, greedy_answer, run_soak, table

STARTUP_S = 400  # two workers load SmolLM2 on a shared 2-core machine
MAX_MODEL_LEN = 512


def soak_stack_config(kv_cache_dtype: str = "auto", kv_cache_memory: str = "48MiB") -> StackConfig:
    """`kvmesh up --metrics` (one prefill and one decode worker) with a KV pool small enough that a
    burst preempts: the soak reaches the recompute paths too."""
    return StackConfig(port=0, kv_cache_dtype=kv_cache_dtype, startup_timeout_s=STARTUP_S, log_level="warning",
                       kvstore_capacity_bytes=64 << 20, metrics=True,
                       engine_flags=("--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN),
                                     "--kv-cache-memory", kv_cache_memory))


def probes(stack: Stack) -> QuietProbes:
    workers = tuple(url for name, url in stack.metrics_urls.items() if name.startswith(("prefill", "decode")))
    assert workers, stack.metrics_urls
    return QuietProbes(gateway_metrics=stack.metrics_urls["gateway"], worker_metrics=workers,
                       kvstores=tuple(c.health for c in stack.children if c.role == "kvstore"))


def logged_errors(log_path) -> list[str]:
    """The services' ERROR lines, tracebacks and event loops held by a blocking call (their output, as
    `kvmesh up` prints it; kvmesh.loop_watch)."""
    with open(log_path) as f:
        return [line.rstrip() for line in f
                if " ERROR " in line or "Traceback" in line or "event loop has been held" in line][:20]


def stack_pids(stack: Stack) -> set[int]:
    """The stack's processes and their descendants (a worker's engine process): whose shared-memory
    segments the stack must give back. Other kvmesh processes on the machine are not its business."""
    pids = {c.pid for c in stack.children}
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    grown = True
    while grown:
        more = {pid for pid, parent in parents.items() if parent in pids} - pids
        pids |= more
        grown = bool(more)
    return pids


def segments_of(pids: set[int]) -> set[str]:
    """Shared-memory segments in /dev/shm that processes `pids` created ("kvmesh-<pid>-<random>")."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if n.startswith("kvmesh-") and n.split("-")[1].isdigit() and int(n.split("-")[1]) in pids}


@pytest.mark.timeout(STARTUP_S + 400)
def test_the_stack_holds_under_a_soak_and_gives_everything_back(tmp_path):
    log = tmp_path / "stack.log"
    with open(log, "w") as out, Stack(soak_stack_config(), log=out) as stack:
        model = "smollm2"
        reference = asyncio.run(greedy_answer(stack.url, model))
        report = asyncio.run(run_soak(stack.url, model, SoakConfig(seconds=30, clients=6, seed=1,
                                                                   max_model_len=MAX_MODEL_LEN)))
        print(table(report))
        assert not report.problems, "\n".join(report.problems)
        kinds = {k for k, _ in report.counts}
        assert {"chat", "chat_stream", "fuzz", "abandon_stream"} <= kinds, report.counts  # the mix ran
        assert sum(n for (k, o), n in report.counts.items() if k == "fuzz" and o != "200") > 0
        held = asyncio.run(check_quiet(probes(stack)))
        assert not held, "\n".join(held)
        assert asyncio.run(greedy_answer(stack.url, model)) == reference
        assert not [c.name for c in stack.children if c.popen.poll() is not None]  # nobody died
        assert not logged_errors(log), "\n".join(logged_errors(log))
        pids = stack_pids(stack)
    assert not segments_of(pids)  # every shared-memory segment went with its process
