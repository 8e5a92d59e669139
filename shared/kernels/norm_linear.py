"""RMSNorm, a linear layer and its activation in one Triton launch (GPU, decode-sized batches).

A decode step of a small model is bound by its kernel count, not its bytes: each layer ran RMSNorm,
a cuBLAS GEMM and RoPE for its q/k/v, and RMSNorm, a GEMM and the gated SiLU for its MLP, six
kernels a CUDA graph replays one after another. Here each triple is one kernel:

- `norm_qkv_rope`: qkv = rope(rms_norm(x) @ W_qkv^T + b), the keys minus their centers (FP8 and INT4 KV);
- `norm_gate_up`: h = silu(rms_norm(x) @ W_gate^T) * (rms_norm(x) @ W_up^T).

One program computes a [BM rows, BN channels] tile of two accumulators side by side whose weight
rows lie a fixed distance apart, so the epilogue combines them in registers:
- RoPE's rotate-half pairs channel c with c + D/2 of the same head: acc1 holds channels
  [j, j + BN) of the first half, acc2 the same of the second, and out1 = acc1 cos - acc2 sin,
  out2 = acc2 cos + acc1 sin (heads past the keys, the values, are stored as they are);
- the gated SiLU pairs gate channel i with up channel I + i: out = silu(acc1) * acc2.

The norm in the same loop: each loaded x tile adds its squares to the rows' sums (fp32) and, times
the norm's weight and rounded to x's dtype, feeds the dot; the rows' 1 / rms scales the fp32
accumulators after the loop (a scale per row commutes with the GEMM; a first pass for the sums
would be a second chain of dependent loads). The rows are rounded unscaled, x times the weight
(fp16: finite while the residual stream is), where the unfused path rounds them scaled; the
accumulators stay fp32 through the epilogue and are rounded once (the unfused path rounds the
GEMM's output, then RoPE's or the SiLU's).
Tiles by batch size (`_tiles`) were chosen from `benchmarks/norm_linear.py` on the H200.
Opt-in (`--fuse-norm-linears`): alone 1.05-1.27x the three kernels' time at SmolLM2-135M's shape,
whole layers 1.11x, but no measurable gain in a serving step's CUDA graph (docs/kernels.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvmesh.kernels.formats import to_bf16_rne

ROPE, SILU = 0, 1
# where the fused kernel beat RMSNorm + cuBLAS + RoPE / SiLU in `benchmarks/norm_linear.py` (H200,
# SmolLM2-135M's hidden 576, 1.05-1.27x): the attention's up to 128 rows, the MLP's up to 72; a
# hidden size of 1,536 or more lost at every batch (0.07-0.82x), so those models stay unfused
MAX_ROWS = {ROPE: 128, SILU: 72}
MAX_HIDDEN = 1024  # 576 measured; 960 (SmolLM2-360M) not


@triton.jit
def _round(x, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 x rounded to dtype, to nearest even (the interpreter's own bf16 cast truncates)."""
    if SOFT_BF16:
        return to_bf16_rne(x)
    return x.to(dtype)


@triton.jit
def _norm_linear_kernel(x_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, cos_ptr, sin_ptr, center_ptr,
                        M, K, eps, stride_xm, stride_om, stride_cos, stride_sin, pair_rows, rotated_heads,
                        key_head0, IS_ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, CENTER: tl.constexpr,
                        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        DOT: tl.constexpr, SOFT_BF16: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)  # [BM]
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    kk = tl.arange(0, BK)  # [BK]

    # the program's two weight tiles: rows r1 + n and r1 + pair_rows + n
    n = tl.arange(0, BN)  # [BN]
    if IS_ROPE:
        tiles = (D // 2) // BN  # a head's first half in BN-channel tiles
        head = pid_n // tiles
        half_col = (pid_n % tiles) * BN + n  # [BN] channel within the first half
        r1 = head * D + half_col
        n_ok = half_col < D // 2
    else:
        r1 = pid_n * BN + n
        n_ok = r1 < pair_rows
    r2 = r1 + pair_rows
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    sumsq = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + kk) < K
        x = tl.load(x_rows + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
        g = tl.load(norm_w_ptr + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        a = _round(x * g[None, :], x_ptr.dtype.element_ty, SOFT_BF16).to(DOT)  # [BM, BK], the row's scale after
        w_mask = k_ok[:, None] & n_ok[None, :]
        b1 = tl.load(w_ptr + r1.to(tl.int64)[None, :] * K + (k0 + kk)[:, None], mask=w_mask, other=0.0)
        b2 = tl.load(w_ptr + r2.to(tl.int64)[None, :] * K + (k0 + kk)[:, None], mask=w_mask, other=0.0)
        acc1 = tl.dot(a, b1.to(DOT), acc1)  # [BM, BN]
        acc2 = tl.dot(a, b2.to(DOT), acc2)
    rstd = 1.0 / tl.sqrt(sumsq / K + eps)  # [BM]: RMSNorm's row scale commutes with the GEMM
    acc1 *= rstd[:, None]
    acc2 *= rstd[:, None]
    if HAS_BIAS:
        acc1 += tl.load(bias_ptr + r1, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(bias_ptr + r2, mask=n_ok, other=0.0).to(tl.float32)[None, :]

    out_t = out_ptr.dtype.element_ty
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_om  # [BM, 1]
    mask = row_ok[:, None] & n_ok[None, :]
    if IS_ROPE:
        if head < rotated_heads:  # q and k; cos[c] = cos[c + D/2] (HF's duplicated halves)
            cos = tl.load(cos_ptr + rows.to(tl.int64)[:, None] * stride_cos + half_col[None, :], mask=mask,
                          other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + rows.to(tl.int64)[:, None] * stride_sin + half_col[None, :], mask=mask,
                          other=0.0).to(tl.float32)
            o1 = acc1 * cos - acc2 * sin
            o2 = acc2 * cos + acc1 * sin
            if CENTER:
                if head >= key_head0:  # keys: the rotated key rounded, minus its center, rounded
                    c = center_ptr + (head - key_head0) * D + half_col  # [BN]
                    o1 = (_round(o1, out_t, SOFT_BF16).to(tl.float32)
                          - tl.load(c, mask=n_ok, other=0.0).to(tl.float32)[None, :])
                    o2 = (_round(o2, out_t, SOFT_BF16).to(tl.float32)
                          - tl.load(c + D // 2, mask=n_ok, other=0.0).to(tl.float32)[None, :])
        else:
            o1 = acc1
            o2 = acc2
        tl.store(out_rows + r1[None, :], _round(o1, out_t, SOFT_BF16), mask=mask)
        tl.store(out_rows + (r1 + D // 2)[None, :], _round(o2, out_t, SOFT_BF16), mask=mask)
    else:
        h = acc1 / (1.0 + tl.exp(-acc1)) * acc2
        tl.store(out_rows + r1[None, :], _round(h, out_t, SOFT_BF16), mask=mask)


@dataclass(frozen=True)
class Tiles:
    """One launch's tile shape: rows BM, channels BN (per accumulator), reduction BK."""
    bm: int
    bn: int
    bk: int = 64
    warps: int = 4
    stages: int = 3


def _tiles(M: int, epilogue: int, half: int) -> Tiles:
    """The tile shape for M rows: 16-row tiles, the fastest in the sweep wherever fusing won (more
    programs in flight beat fewer reads of the weights, which L2 serves again); the MLP past 32
    rows with 64 channels."""
    if epilogue == SILU and M > 32:
        return Tiles(bm=16, bn=64, stages=3)
    return Tiles(bm=16, bn=min(32, half), stages=4)


def takes(x: torch.Tensor, weight: torch.Tensor, epilogue: int) -> bool:
    """Whether the model should fuse x [T, K] against weight [N, K] for `epilogue` (ROPE, SILU):
    kernels that can read them, where they were measured to beat the unfused path."""
    return _reads(x, weight) and x.shape[0] <= MAX_ROWS[epilogue] and x.shape[1] <= MAX_HIDDEN


def _reads(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A GPU (or the interpreter), fp16 / bf16, contiguous channels and weight, rows to compute."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return ((x.is_cuda or interpret) and x.dtype in (torch.float16, torch.bfloat16) and x.dim() == 2
            and x.shape[0] > 0 and x.stride(1) == 1 and weight.is_contiguous()
            and weight.dtype == x.dtype and weight.shape[1] == x.shape[1])


def _dot_dtype(x: torch.Tensor) -> dict:
    """The dot's input dtype and the rounding: the interpreter's bf16 dot and bf16 cast are broken
    (environment.md): fp32 dots and an integer rounding there."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return dict(DOT=tl.float32, SOFT_BF16=x.dtype == torch.bfloat16)
    return dict(DOT=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16, SOFT_BF16=False)


def norm_qkv_rope(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                  bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                  key_center: torch.Tensor | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """x [T, K] (the layer's input, before its norm), weight [(H + 2 KVH) D, K] (q, k, v rows),
    cos / sin [T, 1, D] -> [T, H + 2 KVH, D]: q and k rotated (keys minus key_center [KVH, D]), v."""
    T, K = x.shape
    D = weight.shape[0] // (heads + 2 * kv_heads)
    if (D * (heads + 2 * kv_heads) != weight.shape[0] or D & (D - 1) or D < 32 or not _reads(x, weight)
            or cos.shape[-1] != D or sin.shape[-1] != D):
        raise ValueError(f"norm_qkv_rope: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, heads {heads}/{kv_heads}, cos {tuple(cos.shape)}")
    t = tiles or _tiles(T, ROPE, D // 2)
    if (D // 2) % t.bn:
        raise ValueError(f"norm_qkv_rope: {t.bn} channels a tile do not divide a head's half ({D // 2})")
    out = torch.empty(T, heads + 2 * kv_heads, D, dtype=x.dtype, device=x.device)
    center = x if key_center is None else key_center.contiguous()  # any pointer where CENTER is off
    grid = (triton.cdiv(T, t.bm), (heads + 2 * kv_heads) * (D // 2 // t.bn))
    _norm_linear_kernel[grid](
        x, norm_weight, weight, x if bias is None else bias, out, cos, sin, center, T, K, eps, x.stride(0),
        out.stride(0), cos.stride(0), sin.stride(0), D // 2, heads + kv_heads, heads, IS_ROPE=True,
        HAS_BIAS=bias is not None, CENTER=key_center is not None, D=D, BM=t.bm, BN=t.bn, BK=t.bk,
        **_dot_dtype(x), num_warps=t.warps, num_stages=t.stages)
    return out


def norm_gate_up(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                 tiles: Tiles | None = None) -> torch.Tensor:
    """x [T, K] (before its norm), weight [2I, K] (the gate's rows, then the up projection's) ->
    silu(gate) * up [T, I]."""
    T, K = x.shape
    inter = weight.shape[0] // 2
    if weight.shape[0] % 2 or not _reads(x, weight):
        raise ValueError(f"norm_gate_up: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    t = tiles or _tiles(T, SILU, inter)
    out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(T, t.bm), triton.cdiv(inter, t.bn))
    _norm_linear_kernel[grid](
        x, norm_weight, weight, x, out, x, x, x, T, K, eps, x.stride(0), out.stride(0), 0, 0, inter, 0, 0,
        IS_ROPE=False, HAS_BIAS=False, CENTER=False, D=1, BM=t.bm, BN=t.bn, BK=t.bk, **_dot_dtype(x),
        num_warps=t.warps, num_stages=t.stages)
    return out
