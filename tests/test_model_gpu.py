"""The model on a CUDA GPU vs transformers on the same GPU: fp32 through both attention backends,
bf16 through the Triton backend, chunked prefill + decode. Run on the H200 machine."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.model.loader import load_model

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5,
        attention_bias=True, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            (p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.06))
    hf.save_pretrained(path)
    return path, hf.to(DEV)


def _backend(name: str):
    if name == "torch":
        from kvmesh.kernels.torch_ref import TorchBackend
        return TorchBackend()
    from kvmesh.kernels.triton_backend import TritonBackend
    return TritonBackend()


def _step(model, cache, backend, ids: list[int], prefix: int, table: list[int], slot: int) -> torch.Tensor:
    meta = build_attention_metadata([SeqSlice(prefix, len(ids), table, slot)], cache.layout,
                                    cache.num_residual_slots, DEV)
    h = model(torch.tensor(ids, device=DEV), torch.arange(prefix, prefix + len(ids), device=DEV),
              meta, cache, backend)
    return model.compute_logits(h)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_and_decode_match_transformers_on_gpu(tiny, backend, dtype):
    path, hf = tiny
    torch.backends.cuda.matmul.allow_tf32 = False
    model, cfg = load_model(str(path), dtype, DEV)
    assert next(model.parameters()).device.type == "cuda"
    ids = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device=DEV)).logits[0].float()  # fp32 truth
        hf_err = (hf.to(dtype)(torch.tensor([ids], device=DEV)).logits[0].float() - ref).abs().max().item()
    hf.float()
    kv = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    cache = KVCache(BlockLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, kv), 64, 4, dtype, DEV)
    table = list(range(20, 30))
    be = _backend(backend)
    parts = [_step(model, cache, be, ids[:70], 0, table, 3), _step(model, cache, be, ids[70:149], 70, table, 3),
             _step(model, cache, be, ids[149:], 149, table, 3)]
    got = torch.cat(parts)
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    print(f"{backend} {dtype}: max |dlogit| vs fp32 transformers {err:.2e} (transformers in {dtype}: {hf_err:.2e})")
    if dtype == torch.float32:
        assert err <= 2e-3
    else:  # as close to the fp32 truth as transformers itself gets in bf16
        assert err <= 2 * hf_err + 0.02
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
