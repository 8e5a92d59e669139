"""Where a serving step's time goes on the GPU: `gpu_serving.py`'s load on one engine, every step
timed three ways, and a few steps with prompt chunks under torch.profiler:

    python3 benchmarks/step_profile.py [--kv int4] [--profiled 3] [--profiled-decode 0] [--cprofile]
        [--eager-prompts] [--fused-norm-linears on|off] [--kv-memory-mib 512] [--requests 256]

Per step (`runner.execute` only; sampling and the engine's host work are the rest of `engine.step`):
  host  = from the call to its return (the host's enqueueing, and any sync inside it),
  gpu   = CUDA events around the call (the stream's span, idle gaps included: the GPU waits,
          synchronized, while the host fills the step's buffers, so the span holds the host's part),
  span - host = about what the GPU computes once the step is launched (a graph's replay: ~ its
          kernels' own time, H200 2026-12-03),
  wall  = from the call to the stream's end (synchronized after every call, which is what the
          engine's sampling does anyway).
Then, for eager steps: the kernels' own time summed from the profiler against the wall, and the
profiler's tables by device time and by host time. What it tells: whether an eager step is
bound by its kernels (busy ~ wall) or by the host launching them (busy << wall ~ host).
Steps are of three kinds: decode graphs, prompt graphs (`engine/chunk_graphs.py`) and eager (with
`--eager-prompts`, prompt graphs off, as before 2026-12-03: every step with a prompt chunk).
`--profiled-decode N`: N decode-graph replays under torch.profiler too (after the first 100 decode
steps, so that their graphs are captured), their kernels by device time: what a decode step's GPU
time is made of now that async scheduling hides the host's work.
`--cprofile`: every other eager step also runs under cProfile (its wall then excluded from the
table), and the host's time in them is printed by cumulative and by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import gpu_serving as gs  # benchmarks/gpu_serving.py (puts kvmesh on the path too)


@dataclasses.dataclass
class StepTimes:
    kind: str  # "decode graph", "prompt graph" or "eager"
    tokens: int
    decode_rows: int
    host_ms: float
    gpu_ms: float
    wall_ms: float
    busy_ms: float | None = None  # profiled steps: the kernels' own time


class TimedRunner:
    """Wraps `runner.execute`: times each call, profiles the first `profiled` eager ones."""

    def __init__(self, runner, profiled: int, host_profile: bool, profiled_decode: int = 0) -> None:
        self.runner, self.execute, self.left = runner, runner.execute, profiled
        self.left_decode, self.decode_steps = profiled_decode, 0
        self.steps: list[StepTimes] = []
        self.tables: list[str] = []
        self.host = cProfile.Profile() if host_profile else None
        self.eager = 0

    def __call__(self, chunks, slices, rows, feed=None):
        kind = "eager"
        for name, g in (("decode graph", self.runner.graphs), ("prompt graph", self.runner.chunk_graphs)):
            if kind == "eager" and g is not None and g.takes(slices, rows.sample_rows, rows.prompt_rows):
                kind = name
        graph = kind != "eager"
        prof, host = None, None
        chunk = self.runner.chunk_graphs
        tokens = sum(len(c) for c in chunks)
        # a prompt graph's replay, not its capture (which the profiler may disturb)
        ready = kind == "eager" or (kind == "prompt graph"
                                    and min(b for b in chunk.buckets if b >= tokens) in chunk.captured)
        self.decode_steps += kind == "decode graph"
        if kind == "decode graph" and self.decode_steps > 100 and self.left_decode > 0:
            self.left_decode -= 1
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        elif ready and self.left > 0:
            self.left -= 1
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        elif not graph and self.host is not None:
            self.eager += 1
            host = self.host if self.eager % 2 == 0 else None
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        if host is not None:
            host.enable()
        result = self.execute(chunks, slices, rows, feed)
        if host is not None:
            host.disable()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        step = StepTimes(kind, tokens, sum(len(c) == 1 for c in chunks),
                         (t1 - t0) * 1e3, start.elapsed_time(end), (t2 - t0) * 1e3)
        if host is not None:
            step.busy_ms = -1.0  # not a clean timing: out of the table
        if prof is not None:
            prof.__exit__(None, None, None)
            events = prof.key_averages()
            kernels = (e for e in prof.events() if e.device_type == DeviceType.CUDA)  # not the ops above them
            step.busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3
            self.tables.append(f"{kind} step: {step.tokens} tokens, {step.decode_rows} decode rows, wall "
                               f"{step.wall_ms:.1f} ms (profiled), kernels {step.busy_ms:.1f} ms\n"
                               + events.table(sort_by="self_device_time_total", row_limit=25)
                               + events.table(sort_by="self_cpu_time_total", row_limit=25))
        self.steps.append(step)
        return result


def summary(steps: list[StepTimes], kind: str) -> str:
    s = [x for x in steps if x.kind == kind and x.busy_ms is None]
    if not s:
        return f"| {kind} | 0 |"
    med = lambda f: statistics.median(f(x) for x in s)  # noqa: E731
    return (f"| {kind} | {len(s)} | {med(lambda x: x.tokens):.0f} | "
            f"{med(lambda x: x.decode_rows):.0f} | {med(lambda x: x.host_ms):.2f} | {med(lambda x: x.gpu_ms):.2f} | "
            f"{med(lambda x: x.gpu_ms - x.host_ms):.2f} | {med(lambda x: x.wall_ms):.2f} | "
            f"{sum(x.wall_ms for x in s) / 1e3:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="int4")
    ap.add_argument("--kv-memory-mib", type=int, default=512)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--spread", type=float, default=0.75)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--profiled", type=int, default=3, help="eager steps under torch.profiler")
    ap.add_argument("--profiled-decode", type=int, default=0, help="decode-graph replays under torch.profiler")
    ap.add_argument("--cprofile", action="store_true", help="every other eager step under cProfile")
    ap.add_argument("--fused-norm-linears", default="off", choices=["on", "off"],
                    help="on: RMSNorm, the GEMM and RoPE / SiLU as one kernel each (`--fuse-norm-linears`)")
    ap.add_argument("--eager-prompts", action="store_true", help="prompt steps eagerly (no prompt graphs)")
    a = ap.parse_args()
    load = gs.make_load(a.requests, a.prompt_len, a.new_tokens, a.spread)
    llm = gs.make_llm(a.kv, load, a.kv_memory_mib << 20, a.max_num_seqs, "cuda", a.fused_norm_linears == "on")
    eng = llm.llm_engine
    gs.drive(eng, load, load.params(cap=16), "cuda", "warm")
    if a.eager_prompts:
        eng.runner.chunk_graphs = None
    timed = TimedRunner(eng.runner, a.profiled, a.cprofile, a.profiled_decode)
    eng.runner.execute = timed
    row = gs.drive(eng, load, load.params(), "cuda", "timed")
    print(f"SmolLM2 bf16, {a.kv} KV, {a.kv_memory_mib} MiB pool, {a.requests} requests (gpu_serving's load), "
          f"{torch.cuda.get_device_name()}: {row['wall']:.2f} s, {row['tokens_s']:.0f} tokens/s with a sync a step\n")
    print("| steps | count | tokens (median) | decode rows | host ms | gpu span ms | span - host ms | wall ms | "
          "wall s in all |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in ("eager", "prompt graph", "decode graph"):
        print(summary(timed.steps, kind))
    for p in (x for x in timed.steps if x.busy_ms is not None and x.busy_ms >= 0):
        print(f"profiled {p.kind} step: {p.tokens} tokens, {p.decode_rows} decode rows: kernels {p.busy_ms:.1f} ms "
              f"of {p.wall_ms:.1f} ms wall ({p.busy_ms / p.wall_ms:.0%} busy), host {p.host_ms:.1f} ms (profiled)")
    for t in timed.tables:
        print(t)
    if timed.host is not None:
        print(f"host profile of {timed.eager // 2} eager steps:")
        stats = pstats.Stats(timed.host)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
