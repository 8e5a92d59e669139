"""Helpers for the engine tests (no tests here): tiny random Llama-family models saved as real HF
directories with a real byte-level tokenizer, and a greedy reference loop over transformers."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

VOCAB = 256
EOS = 255
PAGE = 2 * 2 * 2 * 16 * 16 * 4  # a tiny model's fp32 page: layers * K,V * kv_heads * block * head_dim * 4 bytes


def _byte_vocab() -> dict[str, int]:
    # GPT-2's printable mapping of the 256 bytes: every byte is one token, no merges.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def save_byte_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")}))


def make_tiny_model(path: Path, kind: str = "llama", seed: int = 0, head_dim: int = 16) -> transformers.PreTrainedModel:
    """A random tiny model saved to `path` (config, safetensors, tokenizer); returns the HF model.
    head_dim 32 or more suits an INT4 cache (32-channel value groups)."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512,
                rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=EOS)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**base, tie_word_embeddings=True, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**base, tie_word_embeddings=False, rope_theta=1e6)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # fresh random values everywhere, large enough for confident argmaxes
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    hf.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": EOS}))
    save_byte_tokenizer(path)
    return hf


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers' own forward pass with its KV cache (EOS not special)."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past, toks = out.past_key_values, []
    for _ in range(n):
        t = int(out.logits[0, -1].argmax())
        toks.append(t)
        out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return toks


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of transformers' forward pass over the whole sequence."""
    return model(torch.tensor([ids])).logits[0].float()


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = VOCAB - 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (L,), generator=g).tolist() for L in lens]


def run_to_completion(eng) -> dict:
    """Steps an LLMEngine until nothing is left; the final output of each request, by id. Checks the
    allocator's integrity at the end."""
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    eng.kv.check_integrity()
    return final
