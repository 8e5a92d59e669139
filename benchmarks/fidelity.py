"""KV-quantization fidelity on SmolLM2: perplexity and greedy-token agreement, every KV dtype.

Perplexity runs the model through kvmesh's real paged cache with the real torch backend, feeding each
1,024-token window in block-aligned chunks of `block_size` tokens. Each token then sees exactly what it
sees when decoding: every earlier full block quantized in the pool, the tokens of its own block in full
precision (the residual tail). Baseline: the same run with unquantized (fp32) KV.

    python benchmarks/fidelity.py                 # ~50k tokens (50 windows), all dtypes
    python benchmarks/fidelity.py --windows 4     # quick look
    python benchmarks/fidelity.py --windows 0     # greedy agreement only
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from corpus import stdlib_docstrings  # noqa: E402

from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata  # noqa: E402
from kvmesh.kernels.torch_ref import TorchBackend  # noqa: E402
from kvmesh.kv.layout import BlockLayout  # noqa: E402
from kvmesh.kv.pool import KVCache  # noqa: E402
from kvmesh.model.key_centers import centers_keys, load_or_compute  # noqa: E402
from kvmesh.model.loader import load_model, model_cache_dir  # noqa: E402
from kvmesh.model.tokenizer import Tokenizer  # noqa: E402

DTYPES = ("fp32", "fp8_e4m3", "fp8_e5m2", "int8", "int4")


def windows(tokens: list[int], n: int, size: int) -> torch.Tensor:
    """[n, size] non-overlapping windows from the start of the corpus."""
    if len(tokens) < n * size:
        raise SystemExit(f"corpus has {len(tokens)} tokens, need {n * size}")
    return torch.tensor(tokens[: n * size]).view(n, size)


def nll_sum(model, cfg, win: torch.Tensor, kv_dtype: str, block_size: int) -> tuple[float, int]:
    """Summed next-token NLL over a batch of windows [B, W], fed in block-aligned chunks."""
    B, W = win.shape
    layout = BlockLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, kv_dtype)
    pages = W // block_size
    cache = KVCache(layout, B * pages, B, torch.float32)
    backend = TorchBackend()
    tables = [list(range(b * pages, (b + 1) * pages)) for b in range(B)]
    total, count = 0.0, 0
    for c in range(0, W, block_size):
        n = min(block_size, W - c)
        seqs = [SeqSlice(prefix_len=c, num_new=n, block_table=tables[b], residual_slot=b) for b in range(B)]
        meta = build_attention_metadata(seqs, layout, B)
        ids = win[:, c:c + n].reshape(-1)  # [B * n]
        pos = torch.arange(c, c + n).repeat(B)
        logits = model.compute_logits(model(ids, pos, meta, cache, backend)).view(B, n, -1)
        targets = win[:, c + 1:c + n + 1]  # the next token of each position (the last has none)
        m = targets.shape[1]
        lp = torch.log_softmax(logits[:, :m], dim=-1).gather(-1, targets.unsqueeze(-1))
        total -= float(lp.sum())
        count += B * m
    return total, count


def perplexity(model, cfg, win: torch.Tensor, kv_dtype: str, block_size: int, batch: int) -> float:
    total, count = 0.0, 0
    for i in range(0, win.shape[0], batch):
        t, c = nll_sum(model, cfg, win[i:i + batch], kv_dtype, block_size)
        total, count = total + t, count + c
    return math.exp(total / count)


def capacity_ratio(cfg, kv_dtype: str, block_size: int, seq_len: int = 4096) -> float:
    """KV tokens per GiB against fp16, scales and the per-sequence full-precision residual block
    (fp16 on a GPU) counted, at `seq_len`-token sequences."""
    fp16 = BlockLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, "fp16")
    lay = BlockLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                      "fp16" if kv_dtype == "fp32" else kv_dtype)
    blocks = seq_len // block_size
    return blocks * fp16.block_bytes / (blocks * lay.block_bytes + fp16.block_bytes)


def greedy_agreement(prompts: list[str], kv_dtypes: tuple[str, ...], new_tokens: int) -> dict[str, tuple[float, int]]:
    """Per dtype: mean fraction of the first `new_tokens` greedy tokens equal to fp32 KV's, and how
    many of the continuations are identical throughout."""
    from kvmesh import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = {}
    for d in kv_dtypes:
        llm = LLM(model="smollm2", kv_cache_dtype="auto" if d == "fp32" else d, dtype="fp32", device="cpu")
        outs[d] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    base = outs[kv_dtypes[0]]
    res = {}
    for d in kv_dtypes:
        same = [sum(a == b for a, b in zip(x, y)) / new_tokens for x, y in zip(outs[d], base)]
        res[d] = (sum(same) / len(same), sum(x == y for x, y in zip(outs[d], base)))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=50)
    ap.add_argument("--window-size", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--greedy-prompts", type=int, default=8)
    ap.add_argument("--greedy-tokens", type=int, default=128)
    args = ap.parse_args()
    dtypes = tuple(args.dtypes.split(","))
    torch.manual_seed(0)

    tok = Tokenizer.from_model("smollm2")
    tokens = tok.encode(stdlib_docstrings(), add_special_tokens=False)
    win = windows(tokens, args.windows, args.window_size)
    model, cfg = load_model("smollm2", torch.float32, "cpu")  # cfg also sizes the capacity column
    print(f"corpus: {win.numel()} tokens in {args.windows} windows of {args.window_size}; "
          f"block size {args.block_size}", flush=True)

    centers = load_or_compute(model, "smollm2", model_cache_dir("smollm2"))
    ppl = {}
    for d in dtypes if args.windows else ():
        t0 = time.perf_counter()
        # what the engine does: FP8 and INT4 caches hold centered keys (kvmesh.model.key_centers)
        model.set_key_centers(centers if centers_keys(d) else None)
        ppl[d] = perplexity(model, cfg, win, d, args.block_size, args.batch)
        print(f"  {d:9s} perplexity {ppl[d]:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    agree = {}
    if args.greedy_prompts:
        docs = stdlib_docstrings().split("\n\n")
        prompts = [d[:400] for d in docs[:: max(1, len(docs) // args.greedy_prompts)][: args.greedy_prompts]]
        agree = greedy_agreement(prompts, dtypes, args.greedy_tokens)

    base = ppl.get(dtypes[0], float("nan"))
    print(f"\n| KV dtype | perplexity | Δ vs {dtypes[0]} | capacity vs fp16 (4,096-token seqs) "
          f"| greedy agreement ({args.greedy_tokens} tok) | identical continuations |")
    print("|---|---|---|---|---|---|")
    for d in dtypes:
        a = agree.get(d)
        p = ppl.get(d, float("nan"))
        print(f"| {d} | {p:.4f} | {100 * (p / base - 1):+.2f} % | "
              f"{capacity_ratio(cfg, d, args.block_size):.2f}× | "
              f"{'' if a is None else f'{100 * a[0]:.1f} %'} | "
              f"{'' if a is None else f'{a[1]}/{args.greedy_prompts}'} |")


if __name__ == "__main__":
    main()
