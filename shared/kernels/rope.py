"""Rotary position embedding in one Triton launch (GPU): HF's rotate-half, every head of a token in one
program. In torch it is five kernels a layer (a negation, a concatenation, two products, a sum),
which a decode step's CUDA graph replays one after another at a few microseconds each.

out[t, h, c] = x[t, h, c] cos[t, c] + sign(c) x[t, h, (c + D/2) mod D] sin[t, c], sign -1 on the first
half; computed in fp32 and rounded once to x's dtype (torch rounds each of its three ops).

With key centers (FP8 and INT4 KV, `model/key_centers.py`) the same launch also subtracts center[h - first] from
heads h >= first, the keys: the rotated key rounded to x's dtype, then the difference rounded again,
as torch's `k - center` after the rotation rounds it (one kernel a layer fewer, the same bits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, center_ptr, stride_xt, stride_ct, stride_st, heads, first,
                 D: tl.constexpr, HP: tl.constexpr, CENTER: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)[:, None]  # [HP, 1]
    c = tl.arange(0, D)[None, :]  # [1, D]
    mask = (h < heads) & (c < D)
    row = x_ptr + t * stride_xt + h * D
    x = tl.load(row + c, mask=mask).to(tl.float32)  # [HP, D]
    partner = tl.load(row + (c + D // 2) % D, mask=mask).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_ct + c).to(tl.float32)  # [1, D]
    sin = tl.load(sin_ptr + t * stride_st + c).to(tl.float32)
    rotated = tl.where(c < D // 2, -partner, partner)
    out = (x * cos + rotated * sin).to(out_ptr.dtype.element_ty)
    if CENTER:  # keys: minus their head's center, [heads - first, D]
        keys = mask & (h >= first)
        center = tl.load(center_ptr + (h - first) * D + c, mask=keys, other=0.0).to(tl.float32)
        out = tl.where(keys, (out.to(tl.float32) - center).to(out_ptr.dtype.element_ty), out)
    tl.store(out_ptr + (t * heads + h) * D + c, out, mask=mask)


def reads(x: torch.Tensor) -> bool:
    """Whether the kernel reads x [T, heads, D]: rows at any stride, heads and channels contiguous,
    D a power of two."""
    D = x.shape[2]
    return x.stride(2) == 1 and x.stride(1) == D and not D & (D - 1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               key_center: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, heads, D] (`reads(x)`), cos / sin [T, 1, D] -> rotated x, a new contiguous [T, heads, D]
    tensor in x's dtype. key_center [KVH, D] (x's dtype): the last KVH heads are keys and lose it."""
    T, heads, D = x.shape
    if not reads(x):
        raise ValueError(f"x must be [T, heads, D] with contiguous heads and a power-of-two D, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if key_center is not None and (key_center.dim() != 2 or key_center.shape[0] > heads
                                   or key_center.shape[1] != D or key_center.dtype != x.dtype):
        raise ValueError(f"key_center must be [KVH <= {heads}, {D}] {x.dtype}, got {tuple(key_center.shape)} "
                         f"{key_center.dtype}")
    out = torch.empty(T, heads, D, dtype=x.dtype, device=x.device)
    center = x if key_center is None else key_center.contiguous()  # any pointer where CENTER is off
    if T:
        _rope_kernel[(T,)](x, cos, sin, out, center, x.stride(0), cos.stride(0), sin.stride(0), heads,
                           heads - (0 if key_center is None else key_center.shape[0]), D=D,
                           HP=triton.next_power_of_2(heads), CENTER=key_center is not None,
                           num_warps=4 if heads * D >= 2048 else 1)
    return out
