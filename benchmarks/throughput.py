"""CPU serving throughput: kvmesh's engine vs transformers' `generate`, side by side in one run.

Both sides get the same model weights (the converted SmolLM2 cache), the same --dtype, the same
random prompts of one length, the same number of new tokens (EOS ignored on both sides), greedy
decoding, the same torch thread count, batch 1, 8 and 32. Time counts everything from prompt ids in
to token ids out (prefill included). Per batch size the sides alternate --repeats times and the best
run of each counts, so load on a shared machine hits both alike. Two clocks: wall time (tokens/s as
a user sees it) and this process's CPU time (with --threads 1 the work done, less sensitive to other
processes on a shared machine). The greedy tokens of the two sides are compared as a sanity check
(fp32: they agree except where two logits nearly tie; bf16: about half the sequences part somewhere
in 64 tokens of random prompts, at near-ties bf16 cannot order, one bf16 step at |logit| 32-64 being
0.25: tests/test_engine_bf16_cpu.py checks the bf16 numerics on real text). kvmesh runs its CPU
serving path: pre-packed weights, and C kernels (decode attention, bf16 RMSNorm and RoPE, greedy
argmax, on AMX CPUs the bf16 linears of decode steps) compiled on first use, before the timed runs;
transformers runs `generate` as shipped (its default attention, greedy, the KV cache it picks).

    .venv/bin/python benchmarks/throughput.py [--threads 1] [--batch-sizes 1,8,32] [--prompt-len 64]
        [--new-tokens 64] [--repeats 2] [--dtype fp32] [--kv-cache-dtype auto]
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    wall_s: float
    cpu_s: float


def _hf_model(model: str, dtype: torch.dtype):
    import transformers

    from kvmesh.model.config import resolve_model_path
    from kvmesh.model.loader import model_cache_dir, load_model

    path = resolve_model_path(model)
    if path.is_file():
        load_model(model, torch.float32, "cpu")  # makes sure the converted HF directory exists
        path = model_cache_dir(model)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=g).tolist()


def _timed(fn):
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, Timing(time.perf_counter() - t0, time.process_time() - c0)


@torch.inference_mode()
def _run_hf(hf, prompts: list[list[int]], new: int) -> tuple[list[list[int]], Timing]:
    ids = torch.tensor(prompts)
    out, t = _timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                        min_new_tokens=new, do_sample=False, pad_token_id=0))
    if out.shape[1] != ids.shape[1] + new:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, wanted {new}")
    return out[:, ids.shape[1]:].tolist(), t


def _run_kvmesh(llm, prompts: list[list[int]], new: int) -> tuple[list[list[int]], Timing]:
    from kvmesh import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    outs, t = _timed(lambda: llm.generate(prompts, sp))
    toks = [list(o.outputs[0].token_ids) for o in outs]
    if any(len(x) != new for x in toks):
        raise RuntimeError(f"kvmesh generated {[len(x) for x in toks]} tokens, wanted {new}")
    return toks, t


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of sequences whose greedy tokens agree on both sides up to the end (or first tie)."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} cores, load {load:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads, both sides (0 = torch's default)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="weights, both sides")
    ap.add_argument("--repeats", type=int, default=2,
                    help="alternating runs per batch size; the best of each side counts (shared machines)")
    args = ap.parse_args()
    if args.threads < 0 or args.repeats < 1:
        ap.error("--threads must be >= 0 and --repeats >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from kvmesh import LLM

    batches = [int(b) for b in args.batch_sizes.split(",")]
    machine = _machine()
    llm = LLM(args.model, dtype=args.dtype, device="cpu", kv_cache_dtype=args.kv_cache_dtype,
              max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),
              enable_prefix_caching=False)
    hf = _hf_model(args.model, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    vocab = llm.llm_engine.model_config.vocab_size
    warm = _prompts(2, args.prompt_len, vocab, seed=99)
    _run_kvmesh(llm, warm, 4)
    _run_hf(hf, warm, 4)
    rows = []
    for b in batches:
        prompts = _prompts(b, args.prompt_len, vocab, seed=b)
        tk = th = Timing(float("inf"), float("inf"))
        for _ in range(args.repeats):  # alternate so that load changes hit both sides alike
            ok, t = _run_kvmesh(llm, prompts, args.new_tokens)
            tk = Timing(min(tk.wall_s, t.wall_s), min(tk.cpu_s, t.cpu_s))
            oh, t = _run_hf(hf, prompts, args.new_tokens)
            th = Timing(min(th.wall_s, t.wall_s), min(th.cpu_s, t.cpu_s))
        n = b * args.new_tokens
        rows.append((b, n / tk.wall_s, n / th.wall_s, n / tk.cpu_s, n / th.cpu_s, _agreement(ok, oh)))
    print(f"\n{args.model} CPU throughput: {args.dtype} weights, kv {args.kv_cache_dtype}, prompt "
          f"{args.prompt_len}, new {args.new_tokens}, greedy, torch threads {torch.get_num_threads()} "
          f"(both sides), best of {args.repeats}")
    print(f"machine: {machine} at start, {_machine().rsplit('load ', 1)[1]} at end; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print("| batch | kvmesh tok/s | transformers tok/s | ratio (wall) | ratio (CPU time) | same tokens |")
    print("|------:|-------------:|-------------------:|-------------:|-----------------:|------------:|")
    for b, k, h, kc, hc, agree in rows:
        print(f"| {b} | {k:.1f} | {h:.1f} | {k / h:.2f}x | {kc / hc:.2f}x | {agree:.0%} |")


if __name__ == "__main__":
    main()
