"""ModelConfig from HF config.json and GGUF metadata, clear errors, and model identity."""
from __future__ import annotations

import json

import pytest
import torch

from kvmesh.model.config import load_model_config, model_identity, resolve_model_path
from kvmesh.model.loader import load_model
from kvmesh.model.rope import inv_frequencies

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 96, "vocab_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": [5, 7], "torch_dtype": "bfloat16",
}


def _write(tmp_path, cfg: dict, gen: dict | None = None):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return str(tmp_path)


def test_hf_llama31_style_config(tmp_path):
    cfg = load_model_config(_write(tmp_path, LLAMA, {"eos_token_id": [9, 5]}))
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("LlamaForCausalLM", 2, 4, 2, 16)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == (9, 5, 7)  # generation_config first, then config.json's
    assert cfg.torch_dtype == "bfloat16" and not cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.name == tmp_path.name


def test_transformers5_rope_parameters_and_qwen2_bias(tmp_path):
    c = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "rope_scaling", "architectures")}
    c.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6},
             use_sliding_window=False, sliding_window=4096)
    cfg = load_model_config(_write(tmp_path, c))
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias and not cfg.o_proj_bias
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None


def test_smollm2_gguf_config():
    cfg = load_model_config("smollm2")
    assert cfg.architecture == "LlamaForCausalLM" and cfg.name == "smollm2"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert resolve_model_path("smollm2").suffix == ".gguf"


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        load_model_config(_write(tmp_path, {**LLAMA, "architectures": ["GPT2LMHeadModel"]}))


@pytest.mark.parametrize("field,value,match", [
    ("mlp_bias", True, "mlp_bias"),
    ("hidden_act", "gelu", "hidden_act"),
    ("sliding_window", 4096, "sliding_window"),
    ("num_key_value_heads", 3, "num_kv_heads"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "yarn"),
])
def test_unsupported_settings_name_the_field(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        load_model_config(_write(tmp_path, {**LLAMA, field: value}))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no such directory or .gguf file"):
        load_model_config(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        load_model_config(str(tmp_path))
    _write(tmp_path, LLAMA)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="must be a .gguf"):
        load_model_config(str(tmp_path / "w.bin"))


def test_misshapen_tensor_is_named(tmp_path):
    from safetensors.torch import save_file
    from kvmesh.model.llama import LlamaForCausalLM
    _write(tmp_path, LLAMA)
    net = LlamaForCausalLM(load_model_config(str(tmp_path)))
    names = list(net._hf_targets())
    tensors = {n: torch.randn(1) for n in names if n != "model.norm.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="has shape"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_model_identity_is_stable_and_sensitive(tmp_path):
    a = tmp_path / "m"
    a.mkdir()
    _write(a, LLAMA)
    first = model_identity(str(a))
    assert first == model_identity(str(a)) and first.startswith("m-") and len(first) == len("m-") + 16
    _write(a, {**LLAMA, "rope_theta": 10000.0})
    assert model_identity(str(a)) != first
    smol = model_identity("smollm2")
    assert smol.startswith("smollm2-") and smol == model_identity("smollm2")


def test_llama3_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128,
                         rope_parameters={**scaling, "rope_theta": 500000.0})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    got = inv_frequencies(128, 500000.0, scaling)
    assert torch.allclose(got, want.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(got, inv_frequencies(128, 500000.0, None))
