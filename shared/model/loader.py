"""Loads a Llama-family model from an HF directory (safetensors, single or sharded) or a GGUF file.

A GGUF is dequantized once (with gguf's own dequantization) into float32 HF-named tensors and cached
as an HF directory under `cache_root()/<model identity>/` (model.safetensors, config.json, tokenizer
files), so later starts read safetensors instead of dequantizing again. The cache is written to a
temporary directory and renamed into place, so concurrent first starts never see half a cache.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvmesh.model.config import (ModelConfig, cache_root, config_and_identity, load_model_config,
                                 model_identity, resolve_model_path)
from kvmesh.model.llama import LlamaForCausalLM

if TYPE_CHECKING:  # `gguf` is imported only when a GGUF model is loaded
    from kvmesh.model.gguf_file import GGUFFile

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_WEIGHTS_FILE = "model.safetensors"


def load_model(model: str, dtype: torch.dtype, device: torch.device | str) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model with its weights, in `dtype` on `device`, and its config."""
    path = resolve_model_path(model)
    if path.is_file():
        cfg, identity = config_and_identity(model)
        weights_dir = cache_root() / identity
        if not (weights_dir / _WEIGHTS_FILE).is_file():
            return _from_gguf(path, cfg, weights_dir, dtype, device), cfg
    else:
        cfg, weights_dir = load_model_config(model), path
    net = _empty_model(cfg, dtype, device)
    net.load_hf_weights(_safetensors_weights(weights_dir), source=str(weights_dir))
    return net.eval(), cfg


def model_cache_dir(model: str) -> Path:
    """The model's own cache directory: the converted copy of a GGUF model, its key centers (it may
    not exist yet)."""
    return cache_root() / model_identity(model)


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    # build on the meta device: no time spent on random init of weights we overwrite at once
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg)
    return net.to(dtype=dtype).to_empty(device=device)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory (sharded via the index, or single)."""
    index = path / f"{_WEIGHTS_FILE}.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names weight files that do not exist: {missing}")
        return files
    if (path / _WEIGHTS_FILE).is_file():
        return [path / _WEIGHTS_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no weights: expected {_WEIGHTS_FILE} "
                         f"or {_WEIGHTS_FILE}.index.json (only safetensors is supported)")
    return files


def _safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which reorders each head's rows from HF's rotate-half pairing
    (i, i + D/2) to interleaved pairs (2i, 2i + 1): rows [heads, 2, D/2] were stored as [heads, D/2, 2]."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_hf_tensors(g: GGUFFile, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file, dequantized to float32, under HF names (q/k un-permuted)."""
    permuted = g.get("general.architecture") == "llama"  # llama.cpp permutes q/k only for llama
    out: dict[str, torch.Tensor] = {}
    for name in g.tensors:
        if name in _GGUF_GLOBAL_NAMES:
            hf = _GGUF_GLOBAL_NAMES[name]
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                raise ValueError(f"GGUF file {str(g.path)!r}: unexpected tensor {name!r}")
            hf = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        else:
            raise ValueError(f"GGUF file {str(g.path)!r}: unexpected tensor {name!r}")
        w = torch.from_numpy(g.dequantize(name))
        if permuted and ".q_proj." in hf:
            w = _unpermute(w, cfg.num_heads)
        elif permuted and ".k_proj." in hf:
            w = _unpermute(w, cfg.num_kv_heads)
        out[hf] = w.contiguous()
    return out


def _from_gguf(path: Path, cfg: ModelConfig, cache_dir: Path, dtype: torch.dtype,
               device: torch.device | str) -> LlamaForCausalLM:
    from kvmesh.model.gguf_file import GGUFFile
    g = GGUFFile(path)
    tensors = gguf_hf_tensors(g, cfg)
    _write_cache(g, cfg, tensors, cache_dir)
    net = _empty_model(cfg, dtype, device)
    net.load_hf_weights(tensors.items(), source=str(path))
    return net.eval()


def _write_cache(g: GGUFFile, cfg: ModelConfig, tensors: dict[str, torch.Tensor], cache_dir: Path) -> None:
    from kvmesh.model.tokenizer import Tokenizer
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}.", dir=cache_dir.parent))
    try:
        save_file(tensors, str(tmp / _WEIGHTS_FILE), metadata={"format": "pt", "source": g.path.name})
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}, indent=1))
        Tokenizer.from_gguf(g).save(tmp)
        os.replace(tmp, cache_dir)  # atomic; fails if another process got there first
    except OSError:
        if not (cache_dir / _WEIGHTS_FILE).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
