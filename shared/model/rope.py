"""Rotary position embedding (HF's rotate-half convention), plain / linear / llama3 frequencies.

cos/sin are computed per step from the positions of the new tokens (a [T, D/2] outer product), so
there is no table to size and any position up to the int range works.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kvmesh.kernels import rope as rope_kernel


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """float32 [D/2]: the rotation frequency of each channel pair."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        # Llama 3.1: long wavelengths slow down by `factor`, short ones stay, the band between
        # interpolates linearly in (context / wavelength).
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, out)
    raise ValueError(f"rope_scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        # a plain attribute, not a buffer: stays float32 and real through meta-device construction
        # and dtype casts of the model; follows the positions' device on first use
        self.inv_freq = inv_frequencies(head_dim, theta, scaling)  # [D/2] float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int [T] -> cos, sin [T, 1, D] in `dtype` (broadcast over heads)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              key_center: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, heads, D] -> rotated x (first half pairs with second half); key_center [KVH, D]: the
        last KVH heads (the keys) then lose it after the rotation. On a GPU one Triton launch
        (`kernels/rope.py`: five torch kernels a layer otherwise, six with the centers)."""
        if x.is_cuda and rope_kernel.reads(x):
            return rope_kernel.apply_rope(x, cos, sin, key_center)
        out = RotaryEmbedding.rotate(x, cos, sin)
        return out if key_center is None else center_keys(out, key_center)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The torch form of `apply` (the CPU, and the reference of the Triton kernel)."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def center_keys(qk: torch.Tensor, key_center: torch.Tensor) -> torch.Tensor:
    """qk [T, H + KVH, D] rotated, a tensor of its own: its last KVH heads minus key_center [KVH, D],
    in place (`kvmesh.model.key_centers`: softmax ignores a shift that all of a query's keys share)."""
    qk[:, qk.shape[1] - key_center.shape[0]:] -= key_center
    return qk
