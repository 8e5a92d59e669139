"""The fused bf16 decode step (`kvmesh.model.native_decode`: every decoder layer in one C call)
against the model's own layers on tiny random bf16 models: the same hidden states and the same
cache bytes (pages and residual slots) bit for bit, over decode steps that fill residual slots,
complete blocks into their pages and mix sequences of different lengths; with and without QKV and
o_proj biases, GQA and MHA, head_dim 32 and 64; and the steps it must leave to the layers."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvmesh.kernels.cpu_native import load
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.model.loader import load_model
from kvmesh.model.packed_linear import onednn_bf16_packing_works

torch.set_num_threads(1)
native = load()
pytestmark = pytest.mark.skipif(native is None or not onednn_bf16_packing_works() or not native.amx_ready(),
                                reason="needs the C kernels and an AMX CPU (the fused step's only home)")
BS = 8


def _model(tmp_path, bias: bool, kv_heads: int, head_dim: int):
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                                   max_position_embeddings=256, rms_norm_eps=1e-5, attention_bias=bias,
                                   tie_word_embeddings=True)
    torch.manual_seed(kv_heads * 100 + head_dim + bias)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # fresh random values everywhere (HF inits norms to 1 and biases to 0)
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), torch.bfloat16, "cpu")
    assert model.pack_for_cpu()
    return model


def _cache(cfg) -> KVCache:
    return KVCache(BlockLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BS, "bf16"), 40, 6, torch.bfloat16)


def _step(model, cache, seqs, ids, fused: bool, want_fused: bool = False):
    meta = build_attention_metadata(seqs, cache.layout, cache.num_residual_slots, "cpu")
    pos = torch.cat([torch.arange(s.prefix_len, s.prefix_len + s.num_new) for s in seqs])
    backend = TorchBackend(native)
    x = torch.zeros(len(ids), model.config.hidden_size, dtype=torch.bfloat16)
    assert model.native_decode.takes(x, meta, cache, backend) == want_fused
    saved = model.native_decode
    model.native_decode = saved if fused else None
    try:
        return model(torch.tensor(ids), pos, meta, cache, backend)
    finally:
        model.native_decode = saved


@pytest.mark.parametrize("bias,kv_heads,head_dim", [(False, 2, 32), (True, 2, 64), (False, 4, 32)])
def test_fused_decode_step_is_bit_identical_to_the_layers(tmp_path, bias, kv_heads, head_dim):
    model = _model(tmp_path, bias, kv_heads, head_dim)
    assert model.native_decode is not None
    caches = [_cache(model.config), _cache(model.config)]
    gen = torch.Generator().manual_seed(1)
    lens = [3, BS - 2, 2 * BS + 5, 1]  # prompts; decode steps then cross block ends at different steps
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(lens))]
    slots = [5, 0, 3, 1]
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in lens]
    seqs = [SeqSlice(0, n, t, s) for n, t, s in zip(lens, tables, slots)]
    for c in caches:  # the prompts through the layers (a prompt step is not fused)
        _step(model, c, seqs, sum(prompts, []), fused=True)
    assert torch.equal(caches[0].pool, caches[1].pool)
    for step in range(BS + 3):  # every sequence completes a block on the way
        toks = torch.randint(0, 320, (len(lens),), generator=gen).tolist()
        seqs = [SeqSlice(n + step, 1, t, s) for n, t, s in zip(lens, tables, slots)]
        got = _step(model, caches[0], seqs, toks, fused=True, want_fused=True)
        want = _step(model, caches[1], seqs, toks, fused=False, want_fused=True)
        assert torch.equal(got, want), step
        assert torch.equal(caches[0].pool, caches[1].pool) and torch.equal(caches[0].residual, caches[1].residual)


def test_fused_decode_step_leaves_other_steps_to_the_layers(tmp_path):
    model = _model(tmp_path, False, 2, 32)
    step = model.native_decode
    cache = _cache(model.config)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    decode = build_attention_metadata([SeqSlice(3, 1, [0], 0), SeqSlice(5, 1, [1], 1)], cache.layout, 6, "cpu")
    mixed = build_attention_metadata([SeqSlice(3, 1, [0], 0), SeqSlice(0, 4, [1], 1)], cache.layout, 6, "cpu")
    assert step.takes(x, decode, cache, TorchBackend(native))
    assert not step.takes(torch.zeros(5, 128, dtype=torch.bfloat16), mixed, cache, TorchBackend(native))
    assert not step.takes(x, decode, cache, TorchBackend())  # the pure-torch reference backend
    fp8 = KVCache(BlockLayout(2, 2, 32, BS, "fp8_e4m3"), 8, 6, torch.bfloat16)
    assert not step.takes(x, decode, fp8, TorchBackend(native))  # quantized pages: the layers
