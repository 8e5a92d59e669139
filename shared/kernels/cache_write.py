"""Cache write: quantize completed K/V blocks straight into their pages (one fused Triton kernel).

One program per (completed block, KV head group). It gathers the block's `bs` rows from
S = cat(residual rows, new rows) (the `WritePlan` numbering), computes the scales over the whole
block, quantizes, and stores data + scales at the page's byte offsets (`kv/layout.py`). Pages with
id -1 are padding: the program returns at once, so the grid is fixed (CUDA-graph friendly). A decode
batch's plan pairs block i with leftover row i (`WritePlan.paired`): program (i, heads) then also
copies new row i's heads to its residual row, and a step's whole cache write is one launch.
The math follows `kvmesh.kv.quant` exactly: scales rounded to their stored dtype before quantizing,
correctly rounded division (`div_rn`; on the GPU its fma form `formats.div_rn_fma`), round-half-even.
On the GPU fp8 uses the hardware cast; under the interpreter an integer encoder (same bytes, see
docs/kernels.md "Cache write").
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvmesh.kernels.formats import (FMT_CODES, FMT_E4M3, FMT_INT4, FMT_INT8, div_rn_fma, fp16_round_scale,
                                    rint_even, to_bf16_rne)
from kvmesh.kernels.int4_codec import store_int4_k, store_int4_v
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache


@triton.jit
def _gather_raw(res_ptr, new_ptr, rows, slot_stride, res_off, new_stride_t, head, kv: tl.constexpr,
                R, KVH: tl.constexpr, BS: tl.constexpr, cols, D: tl.constexpr):
    """Rows `rows` [BS] of S, channels `cols` [C] -> [BS, C] in the sources' dtype (fp32 if they differ)."""
    rows = rows.to(tl.int32)  # [BS] < 2**31 rows in S; int32 index math, int64 only for the products
    is_new = rows >= R
    r_res = tl.where(is_new, 0, rows)
    r_new = tl.where(is_new, rows - R, 0)
    res_row = (r_res // BS).to(tl.int64) * slot_stride + res_off + ((kv * KVH + head) * BS + r_res % BS) * D
    new_row = r_new.to(tl.int64) * new_stride_t + head * D
    if res_ptr.dtype == new_ptr.dtype:  # one load per row from whichever source holds it
        src = tl.where(is_new, new_ptr + new_row, res_ptr + res_row)  # [BS] pointers
        x = tl.load(src[:, None] + cols[None, :])
    else:
        a = tl.load(res_ptr + res_row[:, None] + cols[None, :], mask=(~is_new)[:, None], other=0.0)
        b = tl.load(new_ptr + new_row[:, None] + cols[None, :], mask=is_new[:, None], other=0.0)
        x = tl.where(is_new[:, None], b.to(tl.float32), a.to(tl.float32))
    return x


@triton.jit
def _gather_heads(res_ptr, new_ptr, rows, c, slot_stride, res_off, new_stride_t, head0, kv: tl.constexpr,
                  R, KVH: tl.constexpr, BS: tl.constexpr, D: tl.constexpr):
    """Rows `rows` of S at channels `c` of heads head0.. side by side (c in [0, HP * D); the two
    broadcast to the tile's shape) -> the tile in the sources' dtype (fp32 if they differ). New rows
    hold the heads contiguously, residual rows BS * D apart."""
    rows = rows.to(tl.int32)  # < 2**31 rows in S; int32 index math, int64 only for the products
    is_new = rows >= R
    r_res = tl.where(is_new, 0, rows)
    r_new = tl.where(is_new, rows - R, 0)
    res_row = (r_res // BS).to(tl.int64) * slot_stride + res_off + ((kv * KVH + head0) * BS + r_res % BS) * D
    new_row = r_new.to(tl.int64) * new_stride_t + head0 * D
    res_c = (c // D) * (BS * D) + c % D
    if res_ptr.dtype == new_ptr.dtype:  # one load per element from whichever source holds its row
        x = tl.load(tl.where(is_new, new_ptr + new_row + c, res_ptr + res_row + res_c))
    else:
        a = tl.load(res_ptr + res_row + res_c, mask=~is_new, other=0.0)
        b = tl.load(new_ptr + new_row + c, mask=is_new, other=0.0)
        x = tl.where(is_new, b.to(tl.float32), a.to(tl.float32))
    return x


@triton.jit
def _store_plain(pool_ptr, base, head, x, FMT: tl.constexpr, BS: tl.constexpr, D: tl.constexpr):
    """x [BS, D] in the sources' dtype; stored as is when that is the page dtype."""
    t = tl.arange(0, BS)
    d = tl.arange(0, D)
    off = (head * BS + t)[:, None] * D + d[None, :]  # [BS, D] elements
    if FMT == 0:
        p = pool_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(p + base // 4 + off, x.to(tl.float32))
    elif FMT == 1:
        p = pool_ptr.to(tl.pointer_type(tl.float16), bitcast=True)
        if x.dtype == tl.float16:
            tl.store(p + base // 2 + off, x)
        else:
            tl.store(p + base // 2 + off, x.to(tl.float32).to(tl.float16))
    else:
        p = pool_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
        if x.dtype == tl.bfloat16:
            tl.store(p + base // 2 + off, x)
        else:
            tl.store(p + base // 2 + off, to_bf16_rne(x.to(tl.float32)))


@triton.jit
def _fp8_encode(y, FMT: tl.constexpr):
    """fp32 (already clamped to +-FMAX) -> fp8 code bytes, round half-to-even, with integer ops:
    the same bits on every GPU and under the interpreter (whose fp8 casts misround)."""
    MANT: tl.constexpr = 3 if FMT == 3 else 2  # mantissa bits
    BIAS: tl.constexpr = 7 if FMT == 3 else 15
    DROP: tl.constexpr = 23 - MANT
    u = y.to(tl.uint32, bitcast=True)
    sign = (u >> 31) << 7
    a = u & 0x7FFFFFFF
    # normal range: round the fp32 mantissa to MANT bits, then rebias the exponent
    r = a + ((1 << (DROP - 1)) - 1) + ((a >> DROP) & 1)
    normal = (r >> DROP) - ((127 - BIAS) << MANT)
    # below the smallest normal (2**(1 - BIAS)): a multiple of the subnormal step 2**(1 - BIAS - MANT)
    STEP_INV: tl.constexpr = 2.0 ** (BIAS - 1 + MANT)
    sub = rint_even(tl.abs(y) * STEP_INV)  # exact: a power-of-two multiply
    is_sub = a < ((128 - BIAS) << 23)  # exponent below 1 - BIAS
    code = tl.where(is_sub, sub.to(tl.uint32), normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _div_by_const(a, C: tl.constexpr, HW: tl.constexpr):
    """div_rn(a, C) for a scale: two fma corrections of a * RN(1/C) (exact for every fp32 a)."""
    if HW:
        return div_rn_fma(a, C, 1.0 / C, 2)
    return tl.math.div_rn(a, C)


@triton.jit
def _store_fp8(pool_ptr, base, scale_base, head, x, amax, FMT: tl.constexpr, BS: tl.constexpr,
               D: tl.constexpr, HW: tl.constexpr, STEPS: tl.constexpr):
    """One scale per (page, layer, head), fp32: s = max(absmax, 1e-6) / FMAX."""
    FMAX: tl.constexpr = 448.0 if FMT == 3 else 57344.0
    s = _div_by_const(tl.maximum(amax.to(tl.float32), 1e-6), FMAX, HW)
    x = x.to(tl.float32)
    t = tl.arange(0, BS)
    d = tl.arange(0, D)
    off = base + (head * BS + t)[:, None] * D + d[None, :]  # [BS, D] bytes
    if HW:
        # The same bytes as the integer path below: q is x / s exactly whenever |x / s| >= 2**-60
        # (div_rn_fma: x, q and the residual are then normal, as s >= 2**-36); below, both paths
        # store x's signed zero. cvt.rn.satfinite rounds half-to-even, makes fp8 subnormals exactly
        # and saturates to +-FMAX: the same as clamping first (|q| <= FMAX * (1 + 2**-23)).
        q = div_rn_fma(x, s, tl.math.div_rn(1.0, s), STEPS)
        F8: tl.constexpr = tl.float8e4nv if FMT == 3 else tl.float8e5
        tl.store(pool_ptr.to(tl.pointer_type(F8), bitcast=True) + off, q.to(F8))
    else:
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FMAX), FMAX)
        tl.store(pool_ptr + off, _fp8_encode(y, FMT))
    ps = pool_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(ps + scale_base // 4 + head, s)


@triton.jit
def _store_int8(pool_ptr, base, scale_base, head, x, BS: tl.constexpr, D: tl.constexpr,
                HW: tl.constexpr, STEPS: tl.constexpr):
    """Symmetric, one fp16 scale per (token, head)."""
    amax = tl.max(tl.abs(x), axis=1).to(tl.float32)  # [BS], exact in the input dtype
    x = x.to(tl.float32)
    s = fp16_round_scale(_div_by_const(tl.maximum(amax, 1e-6), 127.0, HW))  # [BS]
    if HW:
        q = div_rn_fma(x, s[:, None], tl.math.div_rn(1.0, s)[:, None], STEPS)
    else:
        q = tl.math.div_rn(x, s[:, None])
    # clamp, then round half-to-even by adding 1.5 * 2**23: the integer lands in the low mantissa
    # bits (two's complement, 0x400000 has no low byte), so the low byte is the int8 code (no F2I)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0) + 12582912.0
    t = tl.arange(0, BS)
    d = tl.arange(0, D)
    code = q.to(tl.uint32, bitcast=True).to(tl.uint8)
    tl.store(pool_ptr + base + (head * BS + t)[:, None] * D + d[None, :], code)
    ps = pool_ptr.to(tl.pointer_type(tl.float16), bitcast=True)
    tl.store(ps + scale_base // 2 + head * BS + t, s.to(tl.float16))


@triton.jit
def _copy_row(res_ptr, k_ptr, v_ptr, n, d, slot_stride, res_layer_off, stride_kt, stride_vt, h, c,
              KVH: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, mask=None):
    """New row n of k and v [T, KVH, D], heads h [HP, 1] and channels c [1, D'] -> residual row d (slot *
    BS + offset) of one layer, converted to the residual's dtype."""
    n, d = n.to(tl.int64), d.to(tl.int64)
    out = res_ptr + (d // BS) * slot_stride + res_layer_off + (h * BS + d % BS) * D + c  # K half; V KVH BS D on
    ty = res_ptr.dtype.element_ty
    tl.store(out, tl.load(k_ptr + n * stride_kt + h * D + c, mask=mask).to(ty), mask=mask)
    tl.store(out + KVH * BS * D, tl.load(v_ptr + n * stride_vt + h * D + c, mask=mask).to(ty), mask=mask)


@triton.jit
def _cache_write_kernel(
    pool_ptr,  # uint8 [num_pages, page_bytes]
    res_ptr,  # [num_slots, layers, 2, KVH, BS, D] model dtype (contiguous)
    k_ptr,  # [T, KVH, D] new keys
    v_ptr,  # [T, KVH, D] new values
    block_rows_ptr,  # int64 [n_blocks, BS] rows of S = cat(residual rows, new rows)
    block_ids_ptr,  # int64 [n_blocks] destination page, -1 = padding
    res_src_ptr, res_dst_ptr,  # int64 [n_blocks] with PAIRED: new row i (as a row of S) -> residual row
    page_stride,  # bytes between pages
    layer_off,  # layer * layer_bytes
    slot_stride,  # elements between residual slots
    res_layer_off,  # layer * (elements of one layer inside a slot)
    stride_kt, stride_vt,  # elements between new rows (head stride is D)
    R,  # residual rows in S: num_slots * BS
    V_OFF: tl.constexpr, KS_OFF: tl.constexpr, VS_OFF: tl.constexpr,
    FMT: tl.constexpr, KVH: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
    HW: tl.constexpr,  # GPU: hardware fp8 cast and fma division (the interpreter misrounds both)
    STEPS: tl.constexpr,  # Markstein corrections in div_rn_fma: 1 for fp16/bf16 inputs, 2 for fp32
    HP: tl.constexpr,  # KV heads per program (int4; 1 for the other formats)
    PAIRED: tl.constexpr,  # also copy new row blk's heads to residual row res_dst[blk] (WritePlan.paired)
):
    blk = tl.program_id(0)
    head = tl.program_id(1)
    if PAIRED:  # rows no block of this launch reads (WritePlan.paired)
        _copy_row(res_ptr, k_ptr, v_ptr, tl.load(res_src_ptr + blk) - R, tl.load(res_dst_ptr + blk), slot_stride,
                  res_layer_off, stride_kt, stride_vt, head * HP + tl.arange(0, HP)[:, None],
                  tl.arange(0, D)[None, :], KVH, BS, D)
    page = tl.load(block_ids_ptr + blk)
    rows = tl.load(block_rows_ptr + blk * BS + tl.arange(0, BS))  # [BS] int64
    tl.debug_barrier()  # keeps the rows load here, in flight with the page id's, not sunk below the test
    if page >= 0:
        base = page.to(tl.int64) * page_stride + layer_off  # byte offset of this page's layer
        if FMT == 6:  # HP heads side by side: a thread holds all BS tokens of its 8 channels (see int4_heads)
            h0 = head * HP
            c = tl.arange(0, HP * D)[None, :]
            kx = _gather_heads(res_ptr, k_ptr, rows[:, None], c, slot_stride, res_layer_off, stride_kt, h0, 0, R,
                               KVH, BS, D)  # [BS, HP * D]
            # values as [HP * G, BS, 4, 8]: Triton spreads the lanes over the first dims (groups, then
            # tokens), so a thread's 8-channel vectors cover whole 32-channel groups
            g = tl.arange(0, HP * D // 32)[:, None, None, None]
            j = tl.arange(0, 4)[None, None, :, None]
            e = tl.arange(0, 8)[None, None, None, :]
            vx = _gather_heads(res_ptr, v_ptr, rows[None, :, None, None], g * 32 + j * 8 + e, slot_stride,
                               res_layer_off, stride_vt, h0, 1, R, KVH, BS, D)
            store_int4_k(pool_ptr, base, base + KS_OFF, h0, kx, BS, D, HP)
            store_int4_v(pool_ptr, base + V_OFF, base + VS_OFF, base + KS_OFF, h0, vx, BS, D, HP)
        else:
            d = tl.arange(0, D)
            kx = _gather_raw(res_ptr, k_ptr, rows, slot_stride, res_layer_off, stride_kt, head, 0, R, KVH, BS, d, D)
            vx = _gather_raw(res_ptr, v_ptr, rows, slot_stride, res_layer_off, stride_vt, head, 1, R, KVH, BS, d, D)
            if FMT <= 2:
                _store_plain(pool_ptr, base, head, kx, FMT, BS, D)
                _store_plain(pool_ptr, base + V_OFF, head, vx, FMT, BS, D)
            elif FMT <= 4:
                # both tiles' maxima in one cross-warp reduction (exact in the input dtype)
                rk, rv = tl.max(tl.abs(kx), axis=1), tl.max(tl.abs(vx), axis=1)  # [BS] row maxima
                ka, va = tl.split(tl.max(tl.join(rk, rv), axis=0))
                _store_fp8(pool_ptr, base, base + KS_OFF, head, kx, ka, FMT, BS, D, HW, STEPS)
                _store_fp8(pool_ptr, base + V_OFF, base + VS_OFF, head, vx, va, FMT, BS, D, HW, STEPS)
            else:
                _store_int8(pool_ptr, base, base + KS_OFF, head, kx, BS, D, HW, STEPS)
                _store_int8(pool_ptr, base + V_OFF, base + VS_OFF, head, vx, BS, D, HW, STEPS)


def _check_rows(name: str, x: torch.Tensor, L: BlockLayout) -> None:
    if x.dim() != 3 or x.shape[1] != L.kv_heads or x.shape[2] != L.head_dim:
        raise ValueError(f"{name} must be [T, {L.kv_heads}, {L.head_dim}], got {tuple(x.shape)}")
    if x.stride(2) != 1 or x.stride(1) != L.head_dim:
        raise ValueError(f"{name} must have contiguous heads and channels, got strides {x.stride()}")


INT4_WARPS = 1  # int4 write: warps per program (benchmarks/int4_gpu_check.py compares 1, 2, 4)
INT4_MAXNREG = None  # no cap: at 168 / 200 / 224 registers the sm_90 build spills (138 / 94 / 36 STL + LDL)


def int4_heads(kv_heads: int, head_dim: int, num_warps: int, elem_bytes: int = 2) -> int:
    """KV heads per int4 write program: the fewest whose HP * D channels give each of the program's
    threads one 16-byte load a row (8 fp16/bf16 channels, 4 fp32), so the per-channel K reduction over
    the block's tokens stays in registers and each group's codes are computed by one thread, not
    replicated (fp32 rows with 2 heads a warp spilled: 488 STL + LDL on sm_90)."""
    hp = 1
    while hp * head_dim * elem_bytes < 512 * num_warps and kv_heads % (2 * hp) == 0:
        hp *= 2
    return hp


def write_blocks(cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor,
                 block_rows: torch.Tensor, block_ids: torch.Tensor, *,
                 residual: tuple[torch.Tensor, torch.Tensor] | None = None, num_warps: int | None = None,
                 heads_per_program: int | None = None, maxnreg: int | None = -1) -> None:
    """Quantize blocks `block_rows` [n, bs] (rows of cat(residual rows, new rows)) into pages
    `block_ids` [n] (-1 = skip) of `layer`. k, v: [T, KVH, D] new rows. `residual` (src, dst) [n]
    each, a paired plan's (`WritePlan.paired`): new row src[i] also goes to residual row dst[i], in
    the same launch, even where block i is padding. `num_warps`,
    `heads_per_program` and `maxnreg` (int4 only; -1: INT4_MAXNREG, None: no cap) override the
    defaults, for benchmarks."""
    L = cache.layout
    if not 0 <= layer < L.num_layers:
        raise ValueError(f"layer must be in [0, {L.num_layers}), got {layer}")
    _check_rows("k", k, L)
    _check_rows("v", v, L)
    n = int(block_ids.shape[0])
    if block_rows.shape != (n, L.block_size):
        raise ValueError(f"block_rows must be [{n}, {L.block_size}], got {tuple(block_rows.shape)}")
    if residual is not None and any(r.shape != (n,) for r in residual):
        raise ValueError(f"residual src and dst must be [{n}] each (a paired plan), got "
                         f"{[tuple(r.shape) for r in residual]}")
    if n == 0:
        return
    if cache.pool.dtype != torch.uint8 or not cache.pool.is_contiguous():
        raise ValueError("cache.pool must be a contiguous uint8 tensor")
    if not cache.residual.is_contiguous():
        raise ValueError("cache.residual must be contiguous")
    res = cache.residual
    slot_stride = res.stride(0)
    fmt = FMT_CODES[L.kv_dtype]
    if num_warps is None:
        num_warps = INT4_WARPS if fmt == FMT_INT4 else 2 if FMT_E4M3 <= fmt <= FMT_INT8 else 4
    elem = max(res.element_size(), k.element_size(), v.element_size())
    hp = 1 if fmt != FMT_INT4 else heads_per_program or int4_heads(L.kv_heads, L.head_dim, num_warps, elem)
    maxnreg = (INT4_MAXNREG if maxnreg == -1 else maxnreg) if fmt == FMT_INT4 else None
    if L.kv_heads % hp:
        raise ValueError(f"heads_per_program must divide the {L.kv_heads} KV heads, got {hp}")
    _cache_write_kernel[(n, L.kv_heads // hp)](
        pool_ptr=cache.pool, res_ptr=res, k_ptr=k, v_ptr=v,
        block_rows_ptr=block_rows.to(torch.int64).contiguous(),
        block_ids_ptr=block_ids.to(torch.int64).contiguous(),
        res_src_ptr=block_ids if residual is None else residual[0].to(torch.int64).contiguous(),
        res_dst_ptr=block_ids if residual is None else residual[1].to(torch.int64).contiguous(),
        page_stride=L.block_bytes, layer_off=layer * L.layer_bytes,
        slot_stride=slot_stride, res_layer_off=layer * res.stride(1),
        stride_kt=k.stride(0), stride_vt=v.stride(0), R=cache.num_residual_slots * L.block_size,
        V_OFF=L.v_data_offset, KS_OFF=L.k_scale_offset, VS_OFF=L.v_scale_offset,
        FMT=fmt, KVH=L.kv_heads, BS=L.block_size, D=L.head_dim,
        HW=os.environ.get("TRITON_INTERPRET") != "1",
        STEPS=1 if {res.dtype, k.dtype, v.dtype} <= {torch.float16, torch.bfloat16} else 2,
        HP=hp, PAIRED=residual is not None, num_warps=num_warps,
        enable_fp_fusion=fmt != FMT_INT4,  # int4 rounds the product before the rounding add (int4_codec._bits)
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )


@triton.jit
def _residual_rows_kernel(res_ptr, k_ptr, v_ptr, src_ptr, dst_ptr, slot_stride, res_layer_off, stride_kt, stride_vt,
                          R, KVH: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, KVH_P: tl.constexpr,
                          D_P: tl.constexpr):
    """One program per leftover row: new row src - R of k and v [T, KVH, D] -> residual row dst (slot *
    BS + offset) of one layer, every KV head, converted to the residual's dtype; dst -1: a fixed
    plan's spare entry, skipped."""
    m = tl.program_id(0)
    dst = tl.load(dst_ptr + m)
    if dst >= 0:
        h = tl.arange(0, KVH_P)[:, None]  # [KVH_P, 1]
        c = tl.arange(0, D_P)[None, :]  # [1, D_P]
        _copy_row(res_ptr, k_ptr, v_ptr, tl.load(src_ptr + m) - R, dst, slot_stride, res_layer_off,
                  stride_kt, stride_vt, h, c, KVH, BS, D, mask=(h < KVH) & (c < D))


def copy_to_residual(cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor,
                     src: torch.Tensor, dst: torch.Tensor) -> None:
    """Leftover rows `src` of S -> residual rows `dst` (slot * bs + offset; -1 skipped), full
    precision, in one launch. Leftovers are new rows (>= num_slots * bs; `metadata.build_write_plan` and
    `DecodeBatch` make them so): a residual row is either consumed by a completed block or left where
    it is, so no copy reads a row another copy writes. k, v: [T, KVH, D] with contiguous heads."""
    if src.numel() == 0:
        return
    L = cache.layout
    res = cache.residual  # [S, layers, 2, KVH, bs, D]
    _check_rows("k", k, L)
    _check_rows("v", v, L)
    _residual_rows_kernel[(int(src.shape[0]),)](
        res, k, v, src, dst, res.stride(0), layer * res.stride(1), k.stride(0), v.stride(0),
        cache.num_residual_slots * L.block_size, KVH=L.kv_heads, BS=L.block_size, D=L.head_dim,
        KVH_P=triton.next_power_of_2(L.kv_heads), D_P=triton.next_power_of_2(L.head_dim), num_warps=1)
