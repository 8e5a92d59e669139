"""Static key centering (kvmesh.model.key_centers): exact in full precision, smaller FP8 error where
keys carry a large constant offset, computed once per model and cached, switched on by the engine for
FP8 caches only."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_engine_models import make_tiny_model  # noqa: E402
from test_kernels_model import generate, tiny_model  # noqa: E402

from kvmesh.kernels.torch_ref import TorchBackend  # noqa: E402
from kvmesh.model.key_centers import CALIBRATION_TOKENS, calibration_ids, compute_key_centers, load_or_compute  # noqa: E402
from kvmesh.model.llama import LlamaForCausalLM  # noqa: E402

PROMPTS = [torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist(),
           torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(2)).tolist()]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_centering_leaves_full_precision_attention_unchanged():
    model = tiny_model("cpu")
    _, want = generate(model, TorchBackend(), "fp32", PROMPTS, 6, "cpu")
    cfg = model.config
    model.set_key_centers(torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) * 3)
    got_tokens, got = generate(model, TorchBackend(), "fp32", PROMPTS, 6, "cpu")
    assert rel(got, want) < 1e-5  # a shift shared by all keys of a query: softmax ignores it
    model.set_key_centers(None)
    assert model.key_centers() is None


def offset_keys_model() -> LlamaForCausalLM:
    """Keys = small variation + a large constant per channel (as trained models' keys are); a huge
    RoPE base keeps the constant constant after rotation."""
    model = tiny_model("cpu", rope_theta=1e12, attention_bias=True)
    with torch.no_grad():
        for layer in model.layers:
            a = layer.self_attn
            k_rows = slice(a.h * a.d, (a.h + a.kvh) * a.d)
            a.qkv_proj.weight[k_rows] *= 0.2
            a.qkv_proj.bias[k_rows] = torch.randn(a.kvh * a.d) * 8.0
    return model.eval()


# int4 not here: on this tiny model centering moved its logits error only 2.06e-2 -> 1.89e-2 (not
# understood); int4's centered keys are measured on SmolLM2 instead (benchmarks/fidelity.py)
@pytest.mark.parametrize("kv", ["fp8_e4m3"])
def test_centering_cuts_error_on_offset_keys(kv):
    model = offset_keys_model()
    _, ref = generate(model, TorchBackend(), "fp32", PROMPTS, 6, "cpu")
    _, plain = generate(model, TorchBackend(), kv, PROMPTS, 6, "cpu")
    centers = compute_key_centers(model, calibration_ids("none", model.config.vocab_size)[:2048])
    assert centers.shape == (2, 2, 32) and model.key_centers() is None  # computed with centering off
    model.set_key_centers(centers)
    _, centered = generate(model, TorchBackend(), kv, PROMPTS, 6, "cpu")
    e_plain, e_centered = rel(plain, ref), rel(centered, ref)
    assert e_centered < 0.7 * e_plain, f"centered {e_centered:.2e} vs plain {e_plain:.2e}"


def test_centers_are_cached_and_deterministic(tmp_path):
    model = tiny_model("cpu")
    ids = calibration_ids(str(tmp_path / "no-such-model"), model.config.vocab_size)
    assert ids.shape == (CALIBRATION_TOKENS,)  # no tokenizer: seeded ids
    assert torch.equal(ids, calibration_ids(str(tmp_path / "no-such-model"), model.config.vocab_size))
    first = load_or_compute(model, "none", tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("key_centers-*.pt"))) == 1
    assert torch.equal(first, first.half().float())  # fp16 values: every process computes the same
    model.layers[0].self_attn.qkv_proj.weight.data.mul_(2)  # a later call must read the file, not recompute
    assert torch.equal(load_or_compute(model, "none", tmp_path / "cache"), first)


@pytest.mark.parametrize("kv,centered", [("fp8", True), ("int4", True), ("int8", False)])
def test_engine_centers_fp8_and_int4_caches(tmp_path, monkeypatch, kv, centered):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    make_tiny_model(tmp_path / "tiny", "llama", seed=3, head_dim=32)
    from kvmesh import LLM, SamplingParams
    llm = LLM(str(tmp_path / "tiny"), kv_cache_dtype=kv, device="cpu", kv_cache_memory=4 << 20)
    model = llm.llm_engine.runner.model
    assert (model.key_centers() is not None) == centered
    assert bool(llm.llm_engine.runner.key_centers_digest) == centered  # joins the kvstore layout id
    out = llm.generate([[5, 6, 7, 8] * 10], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
