"""The engine's host work outside the model step, a generated token (scheduling, sampling's
bookkeeping, stop checks, detokenizing, building outputs), by completion length and output kind,
side by side in one run:

    python3 benchmarks/engine_host.py [--lengths 128,2048] [--requests 16] [--device cpu]

Each row: `--requests` greedy requests (prompts of 32 random tokens, `length` new tokens each) added
at once to SmolLM2 (`--kv` pages) and stepped to the end; the time inside `runner.execute` (the model)
is taken off the wall time. A CUMULATIVE output copies every completion's tokens each step, so its
cost a token grows with the length; DELTA (the decode server's streams) and FINAL_ONLY (`LLM`) do not.
Then, without the model, what building one sequence's output and sampling row costs a step once its
completion is 128 to 32,768 tokens long.
"""
from __future__ import annotations

import argparse
import time

import torch

import gpu_serving as gs  # benchmarks/gpu_serving.py: SmolLM2 and its loads (kvmesh on the path)
from kvmesh.engine.outputs import OutputKind
from kvmesh.engine.sampling_params import SamplingParams


def host_time(eng, load: gs.Load, kind: OutputKind) -> tuple[float, int, int]:
    """(seconds outside runner.execute, steps, generated tokens) for one pass over `load`."""
    execute, inside = eng.runner.execute, [0.0]

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return execute(*a, **k)
        finally:
            inside[0] += time.perf_counter() - t
    eng.runner.execute = timed
    try:
        base = eng.stats().generation_tokens
        t0 = time.perf_counter()
        for i, (p, sp) in enumerate(zip(load.prompts, load.params())):
            eng.add_request(f"{kind.value}-{i}", p, sp, output_kind=kind)
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        wall = time.perf_counter() - t0
    finally:
        eng.runner.execute = execute
    return wall - inside[0], steps, eng.stats().generation_tokens - base


def output_cost(eng, length: int, kind: OutputKind, reps: int = 2000) -> float:
    """µs the engine spends a step building one running sequence's sampling row and output (its
    `_sample_row` and, but for FINAL_ONLY, `_output`) once its completion is `length` tokens long
    (the tokens appended here, the model not run; max_tokens does not bind outside `step`)."""
    rid = f"cost-{kind.value}-{length}"
    eng.add_request(rid, list(range(100, 132)), SamplingParams(max_tokens=1), output_kind=kind)
    req = eng._requests[rid]
    seq = req.seqs[0]
    for tok in range(1000, 1000 + length):  # a completion of `length` tokens, detokenized
        seq.append_tokens([tok])
        seq.detok.add_token(tok)
    t0 = time.perf_counter()
    for _ in range(reps):  # what `step` does for it, less the model and the token's own bookkeeping
        eng._sample_row(seq)
        if kind is not OutputKind.FINAL_ONLY:
            eng._output(req)
    spent = time.perf_counter() - t0
    eng.abort(rid)
    return spent / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,2048")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv", default="auto", help="KV dtype (auto: bf16, whose CPU decode steps run in C)")
    ap.add_argument("--output-lengths", default="128,1024,8192,32768",
                    help="completion lengths for the output-building table")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    lengths = [int(x) for x in a.lengths.split(",")]
    loads = {n: gs.make_load(a.requests, 32, n, 0.0) for n in lengths}
    llm = gs.make_llm(a.kv, loads[max(lengths)], 256 << 20, a.requests, a.device)
    eng = llm.llm_engine
    host_time(eng, gs.make_load(a.requests, 32, 4, 0.0), OutputKind.DELTA)  # warm-up
    print(f"SmolLM2, {a.kv} KV, {a.requests} greedy requests, 32-token prompts, on {a.device}\n", flush=True)
    print("| new tokens | output kind | steps | host µs a token | host ms a step | ÷ cumulative |")
    print("|---|---|---|---|---|---|")
    for n in lengths:
        base = None
        for kind in OutputKind:
            host, steps, tokens = host_time(eng, loads[n], kind)
            per = host / tokens * 1e6
            base = base or per
            print(f"| {n} | {kind.value} | {steps} | {per:.1f} | {host / steps * 1e3:.2f} | {per / base:.2f} |",
                  flush=True)
    print("\nBuilding one running sequence's output and sampling row, a step (µs):\n")
    print("| completion tokens | cumulative | delta | final_only | cumulative ÷ delta |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in a.output_lengths.split(",")):
        us = {kind: output_cost(eng, n, kind) for kind in OutputKind}
        print(f"| {n} | {us[OutputKind.CUMULATIVE]:.2f} | {us[OutputKind.DELTA]:.2f} | "
              f"{us[OutputKind.FINAL_ONLY]:.2f} | {us[OutputKind.CUMULATIVE] / us[OutputKind.DELTA]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
