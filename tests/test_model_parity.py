"""Our Llama-family model vs transformers' own forward pass, on tiny random models built in code.

Our side runs through the real TorchBackend over a paged fp32 KVCache, with metadata from
build_attention_metadata; a varlen batch of two sequences, and a prefill split into chunks."""
from __future__ import annotations

import zlib

import pytest
import torch
import transformers

from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.model.loader import load_model

BLOCK = 16
TOL = 1e-3

CASES = {
    # name: (config class, kwargs)
    "llama_gqa_llama3_tied": (transformers.LlamaConfig, dict(
        tie_word_embeddings=True, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama_bias_untied": (transformers.LlamaConfig, dict(tie_word_embeddings=False, attention_bias=True)),
    "qwen2_bias_gqa": (transformers.Qwen2Config, dict(tie_word_embeddings=False, rope_theta=1e6)),
    "mistral_mha": (transformers.MistralConfig, dict(num_key_value_heads=4, sliding_window=None)),
}


def _build(tmp_path, case: str, seed: int, **save_kw):
    cls, kw = CASES[case]
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rms_norm_eps=1e-5)
    cfg = cls(**{**base, **kw})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # fresh random values everywhere (HF inits norms to 1 and biases to 0)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path, **save_kw)
    return hf


def _cache(cfg, num_blocks: int = 32, slots: int = 4) -> KVCache:
    layout = BlockLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, "fp32")
    return KVCache(layout, num_blocks, slots, torch.float32)


def _run(model, cache, chunks: list[tuple[list[int], int, list[int], int]]) -> torch.Tensor:
    """One step over several sequences: (token ids, prefix_len, block_table, slot) each -> logits [T, V]."""
    seqs = [SeqSlice(prefix_len=p, num_new=len(ids), block_table=bt, residual_slot=s) for ids, p, bt, s in chunks]
    meta = build_attention_metadata(seqs, cache.layout, cache.num_residual_slots, "cpu")
    ids = torch.tensor([t for c in chunks for t in c[0]], dtype=torch.long)
    pos = torch.cat([torch.arange(c[1], c[1] + len(c[0])) for c in chunks])
    return model.compute_logits(model(ids, pos, meta, cache, TorchBackend()))


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("case", list(CASES))
def test_varlen_batch_matches_transformers(tmp_path, case):
    torch.set_num_threads(1)
    hf = _build(tmp_path, case, seed=zlib.crc32(case.encode()) % 1000)
    model, cfg = load_model(str(tmp_path), torch.float32, "cpu")
    assert cfg.tie_word_embeddings == CASES[case][1].get("tie_word_embeddings", False)
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, 256, (21,), generator=g).tolist()
    b = torch.randint(0, 256, (37,), generator=g).tolist()
    cache = _cache(cfg)
    logits = _run(model, cache, [(a, 0, [0, 1], 0), (b, 0, [2, 3, 4], 1)])
    assert logits.dtype == torch.float32 and logits.shape == (58, 256)
    ref = torch.cat([_hf_logits(hf, a), _hf_logits(hf, b)])
    assert (logits - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("case", ["llama_gqa_llama3_tied", "qwen2_bias_gqa"])
def test_chunked_prefill_and_decode_match_one_shot(tmp_path, case):
    torch.set_num_threads(1)
    hf = _build(tmp_path, case, seed=11, max_shard_size="40KB")  # sharded: index.json path
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, cfg = load_model(str(tmp_path), torch.float32, "cpu")
    ids = torch.randint(0, 256, (42,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = _hf_logits(hf, ids)
    cache = _cache(cfg)
    table = [5, 9, 2]
    # chunk 1: 19 tokens (one full page + 3 residual); chunk 2: 22 more; then one decode token
    out1 = _run(model, cache, [(ids[:19], 0, table, 2)])
    out2 = _run(model, cache, [(ids[19:41], 19, table, 2)])
    out3 = _run(model, cache, [(ids[41:], 41, table, 2)])
    got = torch.cat([out1, out2, out3])
    assert (got - ref).abs().max().item() <= TOL


def test_bf16_forward_as_close_to_fp32_as_transformers_bf16(tmp_path):
    torch.set_num_threads(1)
    hf = _build(tmp_path, "llama_bias_untied", seed=5)
    m16, cfg = load_model(str(tmp_path), torch.bfloat16, "cpu")
    assert m16.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    truth = _hf_logits(hf, ids)
    hf_err = (_hf_logits(hf.to(torch.bfloat16), ids) - truth).abs().max().item()
    c16 = KVCache(BlockLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, "bf16"), 8, 2, torch.bfloat16)
    l16 = _run(m16, c16, [(ids, 0, [0, 1], 0)])
    assert l16.dtype == torch.float32
    err = (l16 - truth).abs().max().item()
    assert 0 < err <= 2 * hf_err + 0.02
