"""The gated MLP's activation, silu(gate) * up, in one Triton launch (GPU). In torch it is two kernels a
layer (the silu, then the product), which a decode step's CUDA graph replays one after the other at a
few microseconds each.

out[t, i] = silu(x[t, i]) * x[t, I + i] for x = [gate | up] [T, 2I]; computed in fp32 and rounded once
to x's dtype (torch rounds the silu, then the product).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # channels a program: 2 KB of bf16 gate and up each, 16-byte loads at 4 warps


@triton.jit
def _gated_silu_kernel(x_ptr, out_ptr, stride_xt, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] channels
    mask = i < inter
    row = x_ptr + t * stride_xt
    gate = tl.load(row + i, mask=mask).to(tl.float32)
    up = tl.load(row + inter + i, mask=mask).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * inter + i, out.to(out_ptr.dtype.element_ty), mask=mask)


def reads(x: torch.Tensor) -> bool:
    """Whether the kernel reads x [T, 2I]: rows at any stride, channels contiguous."""
    return x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1


def gated_silu(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (`reads(x)`), the gate then the up projection -> silu(gate) * up, a new contiguous
    [T, I] tensor in x's dtype."""
    if not reads(x):
        raise ValueError(f"x must be [T, 2I] with contiguous channels, got {tuple(x.shape)} strides {x.stride()}")
    T, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    if T and inter:
        _gated_silu_kernel[(T, triton.cdiv(inter, BLOCK))](x, out, x.stride(0), inter, BLOCK=BLOCK, num_warps=4)
    return out
