"""CPU decode throughput: kvmesh's engine vs transformers' `generate`, side by side in one run.

Same model weights (the converted SmolLM2 cache), same --dtype (fp32), greedy, the same random prompts of one
length, the same number of new tokens (EOS ignored on both sides), batch 1, 8 and 32; best of
--repeats alternating runs per side, so that load on a shared machine hits both alike.

    .venv/bin/python benchmarks/throughput.py [--batch-sizes 1,8,32] [--prompt-len 64] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import time

import torch


def _hf_model(model: str, dtype: torch.dtype):
    import transformers

    from kvmesh.model.config import resolve_model_path
    from kvmesh.model.loader import gguf_cache_dir, load_model

    path = resolve_model_path(model)
    if path.is_file():
        load_model(model, torch.float32, "cpu")  # makes sure the converted HF directory exists
        path = gguf_cache_dir(model)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=g).tolist()


@torch.inference_mode()
def _run_hf(hf, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return dt


def _run_kvmesh(llm, prompts: list[list[int]], new: int) -> float:
    from kvmesh import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == new for o in outs)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="weights, both sides")
    ap.add_argument("--repeats", type=int, default=2,
                    help="alternating runs per batch size; the best of each side counts (shared machines)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvmesh import LLM

    batches = [int(b) for b in args.batch_sizes.split(",")]
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
        tk = th = float("inf")
        for _ in range(args.repeats):  # alternate so that load changes hit both sides alike
            tk = min(tk, _run_kvmesh(llm, prompts, args.new_tokens))
            th = min(th, _run_hf(hf, prompts, args.new_tokens))
        n = b * args.new_tokens
        rows.append((b, n / tk, n / th, th / tk))
    print(f"\nSmolLM2 CPU throughput ({args.model}, {args.dtype} weights, kv {args.kv_cache_dtype}, prompt "
          f"{args.prompt_len}, new {args.new_tokens}, greedy, threads {torch.get_num_threads()})")
    print("| batch | kvmesh tok/s | transformers tok/s | ratio |")
    print("|------:|-------------:|-------------------:|------:|")
    for b, k, h, r in rows:
        print(f"| {b} | {k:.1f} | {h:.1f} | {r:.2f}x |")


if __name__ == "__main__":
    main()
