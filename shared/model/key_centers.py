"""Static key centering for FP8 and INT4 KV caches.

Every post-RoPE key loses a constant vector per (layer, KV head) before it is cached and attended.
Softmax ignores a shift that all of a query's keys share (q . (k - c) = q . k - q . c), so attention
is unchanged in exact arithmetic; what changes is what FP8 has to round. On SmolLM2 the keys' mean
holds 44-70 % of their energy and e4m3's relative rounding hit that offset again in every token
(docs/kv_cache.md, "FP8 levers"). The centers are the mean key over a fixed calibration text,
rounded to fp16 so that every process of a deployment computes the same ones; they are computed once
per model and kept in the model cache directory beside the converted weights. Their digest joins the
kvstore layout id, so a worker never reads pages written under other centers (the calibration text is
the local Python's stdlib source: another Python version may compute other centers). INT4 caches
store keys symmetric around zero (kv/layout.py), which only works once the offset is gone.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import sysconfig

import torch
import torch.nn.functional as F

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kv.pool import KVCache

# 8 windows. The result is sensitive to the centers (the first token's key, which takes 28-65 % of
# later queries' attention, rounds differently under each): SmolLM2 e4m3 +0.25 % from 8,192 tokens,
# +0.56 % from the first 4,096 (docs/kv_cache.md)
CALIBRATION_TOKENS = 8192
WINDOW = 1024
# stdlib modules whose source (code, comments, docstrings) is the calibration text: code calibrated
# the SmolLM2 centers better than prose did (+0.25 % vs +0.42 % perplexity in the lever study)
CODE_MODULES = ("os", "ast", "tokenize", "calendar", "copy", "bisect", "gettext", "locale", "shlex", "glob")


class _KeyMeans:
    """An attention backend for one fresh causal window at a time that also sums each layer's keys."""

    name = "key-means"

    def __init__(self, layers: int, kv_heads: int, head_dim: int) -> None:
        self.sums = torch.zeros(layers, kv_heads, head_dim, dtype=torch.float64)  # [L, KVH, D]
        self.count = 0

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.sums[layer] += k.double().sum(dim=0).cpu()
        self.count += k.shape[0] if layer == 0 else 0
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=True)  # [1, H, T, D]
        return o[0].transpose(0, 1).to(q.dtype)

    def write(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor,
              meta: AttentionMetadata) -> None:
        pass


def centers_keys(kv_dtype: str) -> bool:
    """Whether a cache of this canonical KV dtype holds centered keys (FP8 rounds them, INT4 stores
    them symmetric around zero)."""
    return kv_dtype.startswith("fp8") or kv_dtype == "int4"


def calibration_ids(model: str, vocab_size: int) -> torch.Tensor:
    """CALIBRATION_TOKENS token ids of the calibration text (model's own tokenizer), or seeded
    random ids where the model ships no tokenizer (tiny test models)."""
    try:
        from kvmesh.model.tokenizer import Tokenizer
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        text = "\n\n".join((root / f"{m}.py").read_text(encoding="utf-8") for m in CODE_MODULES)
        ids = Tokenizer.from_model(model).encode(text, add_special_tokens=False)[:CALIBRATION_TOKENS]
        if len(ids) == CALIBRATION_TOKENS:
            return torch.tensor(ids)
    except (OSError, ValueError):
        pass
    return torch.randint(0, vocab_size, (CALIBRATION_TOKENS,), generator=torch.Generator().manual_seed(0))


@torch.inference_mode()
def compute_key_centers(net, ids: torch.Tensor) -> torch.Tensor:
    """Mean post-RoPE key of `net` over ids [N] in WINDOW-token windows -> float32 [L, KVH, D],
    rounded to fp16. Runs with the net's own centers off."""
    cfg = net.config
    saved = net.key_centers()
    net.set_key_centers(None)
    means = _KeyMeans(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    dev = net.embed_tokens.weight.device
    for w in ids.split(WINDOW):
        net(w.to(dev), torch.arange(w.numel(), device=dev), None, None, means)
    net.set_key_centers(saved)
    return (means.sums / means.count).to(torch.float16).float()


def load_or_compute(net, model: str, cache_dir: pathlib.Path) -> torch.Tensor:
    """The model's key centers from `cache_dir/key_centers-<digest of the calibration ids>.pt`,
    computed and saved the first time (another text or length computes anew)."""
    ids = calibration_ids(model, net.config.vocab_size)
    path = cache_dir / f"key_centers-{hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:12]}.pt"
    if path.is_file():
        return torch.load(path, map_location="cpu")
    centers = compute_key_centers(net, ids)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(centers, tmp)
    tmp.replace(path)  # atomic: concurrent workers write the same values
    return centers


def centers_digest(centers: torch.Tensor) -> str:
    """16 hex digits naming a set of centers (their fp16 bytes): pages written under different
    centers must not be read as each other's (kvstore layout id)."""
    return hashlib.sha256(centers.to(torch.float16).numpy().tobytes()).hexdigest()[:16]
