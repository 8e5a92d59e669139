"""The prefill/extend attention kernel (launcher in prefill_attention.py) and what the decode
kernel (decode_attention.py) shares with it: the page-tile loader, the online-softmax step and
the argument checks (the decode kernels' split partials and their reduction: partials.py).

One program = one tile of rows x one KV head. A row is a (new token, query head) pair; the rows of
a tile are TOK_PER_TILE tokens x the G query heads that share the KV head, so each page is read once
per tile for the whole group. Keys of a sequence, in order: its full pages (quantized, read through
the block table and dequantized in registers; for long chunks, read from the fp16 workspace that
`prefix_stage.py` dequantized them into once per step), its residual tail (< bs tokens, full
precision), its new tokens (dense, causal).

Dequantization without float conversion instructions (integer ops + bitcast to fp16):
    fp8 e5m2: fp16 bits = byte << 8                               (exact)
    fp8 e4m3: fp16 bits = sign << 8 | (byte & 0x7f) << 7 = x * 2**-8  (exact; 2**8 folded into scale)
    int8:     fp16(0x6400 | (byte ^ 0x80)) - 1152 = x               (exact)
    int4:     fp32(0x4B000000 | nibble) - 2**23 = q; keys (q - 7.5) s, values q * s + m (scales per element, in-tile)
Per-token scales (fp8 page scale, int8 token scale) multiply the score columns (K) and the
probabilities (V) instead of the tiles: one multiply per token, not per element.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.formats import (FMT_BF16, FMT_CODES, FMT_E4M3, FMT_E5M2, FMT_FP16, FMT_FP32, FMT_INT8,
                                    to_bf16_rne)
from kvmesh.kernels.int4_codec import load_int4_tile
from kvmesh.kv.pool import KVCache

LOG2E = math.log2(math.e)


@triton.jit
def _load_page_tile(pool_ptr, base, tok, n_mask, head, DATA_OFF: tl.constexpr,
                    SCALE_OFF: tl.constexpr, IS_KEY: tl.constexpr, FMT: tl.constexpr,
                    BS: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr):
    """Tokens (page base [N] int64 in `_unit`s, token in page [N]) of one KV head -> (tile [N, D] in DOT,
    per-token scale [N] fp32, or 1.0 where the format has none / folds it into the tile)."""
    d = tl.arange(0, D)
    row = (head * BS + tok).to(tl.int64)  # [N] row of [KVH, BS] inside the region
    m2 = n_mask[:, None]
    one = tl.full(tok.shape, 1.0, tl.float32)
    if FMT <= 2:  # base and offsets count elements here (see `_unit`): no division, 16-byte loads
        if FMT == 0:
            p = pool_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
        elif FMT == 1:
            p = pool_ptr.to(tl.pointer_type(tl.float16), bitcast=True)
        else:
            p = pool_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
        x = tl.load(p + (base + DATA_OFF + row * D)[:, None] + d[None, :], mask=m2, other=0.0)
        return x.to(DOT), one
    elif FMT <= 4:
        b = tl.load(pool_ptr + (base + DATA_OFF + row * D)[:, None] + d[None, :], mask=m2, other=0)
        if NATIVE:  # the hardware conversion (sm_89+), for comparison with the bit operations
            if FMT == 3:
                x = b.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            else:
                x = b.to(tl.float8e5, bitcast=True).to(tl.float16)
            fix = 1.0
        elif FMT == 3:
            b = b.to(tl.uint16)
            bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
            x = bits.to(tl.float16, bitcast=True)
            fix = 256.0  # the exponent-bias gap between e4m3 (7) and fp16 (15)
            x = bits.to(tl.float16, bitcast=True)
        else:
            x = (b.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
            fix = 1.0
        ps = pool_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
        s = tl.load(ps + (base + SCALE_OFF) // 4 + head, mask=n_mask, other=0.0) * fix  # [N]
        return x.to(DOT), s
    elif FMT == 5:
        b = tl.load(pool_ptr + (base + DATA_OFF + row * D)[:, None] + d[None, :], mask=m2, other=0)
        if NATIVE:
            x = b.to(tl.int8, bitcast=True).to(tl.float16)
        else:
            x = ((b.to(tl.uint16) ^ 0x80) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
        ps = pool_ptr.to(tl.pointer_type(tl.float16), bitcast=True)
        s = tl.load(ps + (base + SCALE_OFF) // 2 + row, mask=n_mask, other=0.0).to(tl.float32)
        return x.to(DOT), s
    else:
        # q * s + m in fp32, rounded once: in fp16 (packed half2) the rounding of s and m cost up to
        # 2.3e-3 relative error over 2k-token prefixes for bf16 models (H200, test_kernels_prefix_stage)
        x = load_int4_tile(pool_ptr, base, row, n_mask, head, DATA_OFF, SCALE_OFF, IS_KEY, D, tl.float32)
        return x.to(DOT), one


@triton.jit
def _cast_out(x, ty: tl.constexpr):
    if ty == tl.bfloat16:
        return to_bf16_rne(x)
    else:
        return x.to(ty)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    if DOT == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _softmax_step(acc, m_i, l_i, q, kt, ks, vt, vs, valid, qk_scale, HAS_SCALE: tl.constexpr,
                  DOT: tl.constexpr, LO_ROWS: tl.constexpr = False, MASKED: tl.constexpr = True):
    """One online-softmax step over a key tile. kt, vt: [N, D]; ks, vs: [N]; valid: [M, N] (ignored,
    not computed on, where MASKED is False: every key visible to every row). LO_ROWS:
    q's rows M/2.. repeat rows 0.. (so do their scores, max and sum) and their p is what p loses
    in DOT's precision, so one dot yields both parts (the caller adds the halves once at the end)."""
    s = _dot(q, tl.trans(kt), DOT)  # [M, N] fp32
    if HAS_SCALE:
        s = s * (ks * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # m_i starts finite, so no inf - inf
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if HAS_SCALE:
        # V scales ride on p, normalized by the tile's largest so p stays in fp16's normal range
        # (an e5m2 scale is ~absmax / 57344: p * s alone would sink into subnormals)
        v_max = tl.maximum(tl.max(vs, axis=0), 1e-30)
        acc += _dot((p * (vs / v_max)[None, :]).to(DOT), vt, DOT) * v_max
    elif LO_ROWS:
        p_hi = p.to(DOT)
        p_lo = (p - p_hi.to(tl.float32)).to(DOT)  # 0 where DOT is fp32 (the interpreter)
        lo = (tl.arange(0, p.shape[0]) >= p.shape[0] // 2)[:, None]
        acc += _dot(tl.where(lo, p_lo, p_hi), vt, DOT)
    elif DOT == tl.bfloat16:  # p as hi + lo bf16 parts: bf16's 8-bit mantissa alone costs ~1e-3
        p_hi = p.to(tl.bfloat16)
        acc += _dot(p_hi, vt, DOT) + _dot((p - p_hi.to(tl.float32)).to(tl.bfloat16), vt, DOT)
    else:
        acc += _dot(p.to(DOT), vt, DOT)
    return acc, m_new, l_i


@triton.jit
def _full_pages(acc, m_i, l_i, q, pool_ptr, table_row, n_end, page_stride, layer_off, kvh,
                V_OFF: tl.constexpr, KS_OFF: tl.constexpr, VS_OFF: tl.constexpr, FMT: tl.constexpr,
                HAS_SCALE: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT: tl.constexpr, NATIVE: tl.constexpr, qk_scale):
    """The online softmax over keys [0, n_end) of one sequence's full pages (page ids in table_row)."""
    for n0 in range(0, n_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < n_end
        page = tl.load(table_row + n // BS, mask=nm, other=0).to(tl.int64)
        base = page * page_stride + layer_off  # [N] offset of the page's layer (in units)
        tok = n % BS
        kt, ks = _load_page_tile(pool_ptr, base, tok, nm, kvh, 0, KS_OFF, True, FMT, BS, D, DOT, NATIVE)
        vt, vs = _load_page_tile(pool_ptr, base, tok, nm, kvh, V_OFF, VS_OFF, False, FMT, BS, D, DOT, NATIVE)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kt, ks, vt, vs, nm[None, :], qk_scale, HAS_SCALE, DOT)
    return acc, m_i, l_i


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [T, H, D] new queries
    k_ptr,  # [T, KVH, D] new keys (dense, full precision)
    v_ptr,  # [T, KVH, D] new values
    out_ptr,  # [T, H, D] output
    pool_ptr,  # uint8 [num_pages, page_bytes]
    res_ptr,  # [num_slots, layers, 2, KVH, BS, D] residual tails (contiguous)
    query_start_ptr,  # int32 [B + 1]
    prefix_lens_ptr,  # int32 [B]
    block_tables_ptr,  # int32 [B, max_pages]
    residual_slots_ptr,  # int32 [B]
    stage_ptr,  # fp16 [P, 2, KVH, BS, D] workspace pages (as uint8), when STAGED
    stage_tables_ptr,  # int32 [B, max_pages] workspace page of each full page; rows of -1: not staged
    # (STAGED: 0 = no workspace; a step that staged: 1 = its staged sequences, 2 = the others)
    tiles_ptr,  # int32 [capacity] b << 16 | tile, -1 spare (TILES: a CUDA graph's fixed tile list)
    stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh,
    stride_bt,  # elements between block-table rows
    page_stride,  # units (see `_unit`) between pages
    layer_off,  # layer * layer_bytes, in units
    slot_stride,  # residual elements between slots
    res_layer_off,  # layer * residual elements per layer inside a slot
    stride_st,  # elements between stage-table rows
    stage_page,  # fp16 elements of one workspace page: 2 * KVH * BS * D
    qk_scale,  # softmax scale * log2(e)
    V_OFF: tl.constexpr, KS_OFF: tl.constexpr, VS_OFF: tl.constexpr,
    FMT: tl.constexpr, HAS_SCALE: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
    BS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, TOK_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr, STAGED: tl.constexpr,
    STAGE_V_OFF: tl.constexpr,  # KVH * BS * D
    TILES: tl.constexpr = False,  # grid (capacity x KVH,) over tiles_ptr, an entry's KV heads adjacent
    CAUSAL_SPLIT: tl.constexpr = False,  # the new tokens' keys before the tile's first token unmasked
):
    if TILES:
        entry = tl.load(tiles_ptr + tl.program_id(0) // KVH)
        b = tl.maximum(entry, 0) >> 16
        tile = entry & 0xFFFF
        kvh = tl.program_id(0) % KVH
    else:
        tile = tl.program_id(0)
        b = tl.program_id(1)
        kvh = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    tok0 = tile * TOK_PER_TILE
    prefix = tl.load(prefix_lens_ptr + b)
    n_end = prefix // BS * BS  # keys in full pages
    st_row = stage_tables_ptr + b.to(tl.int64) * stride_st
    mine = tok0 < q_len
    if TILES:
        mine = mine & (entry >= 0)
    if STAGED == 1:  # the staged sequences, and those without full pages
        mine = mine & ((tl.load(st_row) >= 0) | (n_end == 0))
    if STAGED == 2:  # the other sequences of a step that staged some
        mine = mine & (tl.load(st_row) < 0) & (n_end > 0)
    if mine:
        r = tl.arange(0, BLOCK_M)
        rt = r // G
        head = kvh * G + r % G  # [M] query head of each row
        row_tok = tok0 + rt  # [M] new-token index of each row
        row_ok = (rt < TOK_PER_TILE) & (row_tok < q_len)
        d = tl.arange(0, D)
        q_row = (q_start + row_tok).to(tl.int64)
        q = tl.load(q_ptr + (q_row * stride_qt + head * stride_qh)[:, None] + d[None, :],
                    mask=row_ok[:, None], other=0.0).to(DOT)  # [M, D]
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)

        # 1. full pages: from the fp16 workspace that `prefix_stage.py` dequantized them into once
        # per step (STAGED == 1), else read and dequantized here, once per tile
        if STAGED == 1:  # one-layer fp16 workspace pages (format 1 = FMT_FP16)
            acc, m_i, l_i = _full_pages(acc, m_i, l_i, q, stage_ptr, st_row, n_end, stage_page, 0, kvh,
                                        STAGE_V_OFF, 0, 0, 1, False, BS, D, BLOCK_N, DOT, NATIVE, qk_scale)
        else:
            bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
            acc, m_i, l_i = _full_pages(acc, m_i, l_i, q, pool_ptr, bt_row, n_end, page_stride, layer_off,
                                        kvh, V_OFF, KS_OFF, VS_OFF, FMT, HAS_SCALE, BS, D, BLOCK_N, DOT,
                                        NATIVE, qk_scale)

        # 2. residual tail: prefix % BS tokens in full precision
        n_tail = prefix % BS
        if n_tail > 0:
            t = tl.arange(0, BS)
            tm = t < n_tail
            slot = tl.load(residual_slots_ptr + b).to(tl.int64)
            rk = res_ptr + slot * slot_stride + res_layer_off + ((kvh * BS + t) * D)[:, None] + d[None, :]
            kt = tl.load(rk, mask=tm[:, None], other=0.0).to(DOT)
            vt = tl.load(rk + KVH * BS * D, mask=tm[:, None], other=0.0).to(DOT)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kt, kt, vt, vt, tm[None, :], qk_scale,
                                          False, DOT)
        # 3. new tokens, causal
        last = tl.minimum(tok0 + TOK_PER_TILE, q_len)  # keys 0 .. last-1 are visible to some row
        first_masked = 0
        if CAUSAL_SPLIT:  # keys below the tile's first token are visible to every row: no masks
            first_masked = tok0 // BLOCK_N * BLOCK_N
            for j0 in range(0, first_masked, BLOCK_N):
                kr = (q_start + j0 + tl.arange(0, BLOCK_N)).to(tl.int64)
                kt = tl.load(k_ptr + (kr * stride_kt + kvh * D)[:, None] + d[None, :]).to(DOT)
                vt = tl.load(v_ptr + (kr * stride_vt + kvh * D)[:, None] + d[None, :]).to(DOT)
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kt, kt, vt, vt, row_ok[:, None], qk_scale,
                                              False, DOT, MASKED=False)
        for j0 in range(first_masked, last, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            jm = j < last
            kr = (q_start + j).to(tl.int64)
            kt = tl.load(k_ptr + (kr * stride_kt + kvh * D)[:, None] + d[None, :],
                         mask=jm[:, None], other=0.0).to(DOT)
            vt = tl.load(v_ptr + (kr * stride_vt + kvh * D)[:, None] + d[None, :],
                         mask=jm[:, None], other=0.0).to(DOT)
            valid = jm[None, :] & (j[None, :] <= row_tok[:, None])
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kt, kt, vt, vt, valid, qk_scale,
                                          False, DOT)

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        op = out_ptr + (q_row * stride_ot + head * stride_oh)[:, None] + d[None, :]
        tl.store(op, _cast_out(o, out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _dot_dtype(fmt: int, q: torch.Tensor, staged: bool = False) -> tl.dtype:
    """The tl.dot input dtype. fp32 under the interpreter (its bf16 dot is broken), else the page
    dtype for full-precision caches and fp16 for the dequantized ones (exact for fp8/int8/int4 codes)
    and for bf16 pages staged as fp16 (`prefix_stage.py`)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or fmt == FMT_FP32:
        return tl.float32
    return tl.bfloat16 if fmt == FMT_BF16 and not staged else tl.float16


def _unit(fmt: int) -> int:
    """Bytes per offset unit: full-precision pages are addressed in elements, the rest in bytes."""
    return {FMT_FP32: 4, FMT_FP16: 2, FMT_BF16: 2}.get(fmt, 1)


def _check(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           meta: AttentionMetadata) -> None:
    L = cache.layout
    if not 0 <= layer < L.num_layers:
        raise ValueError(f"layer must be in [0, {L.num_layers}), got {layer}")
    if q.dim() != 3 or q.shape[2] != L.head_dim or q.shape[1] % L.kv_heads:
        raise ValueError(f"q must be [T, H, {L.head_dim}] with H a multiple of {L.kv_heads}, got {tuple(q.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.shape != (q.shape[0], L.kv_heads, L.head_dim):
            raise ValueError(f"{name} must be [{q.shape[0]}, {L.kv_heads}, {L.head_dim}], got {tuple(x.shape)}")
        if x.stride(2) != 1 or x.stride(1) != L.head_dim:
            raise ValueError(f"{name} must have contiguous heads and channels, got strides {x.stride()}")
    if q.stride(2) != 1:
        raise ValueError(f"q must be contiguous in head_dim, got strides {q.stride()}")
    if cache.pool.dtype != torch.uint8 or not cache.pool.is_contiguous():
        raise ValueError("cache.pool must be a contiguous uint8 tensor")
    if not cache.residual.is_contiguous():
        raise ValueError("cache.residual must be contiguous")
    if meta.block_tables.dtype != torch.int32 or meta.block_tables.stride(1) != 1:
        raise ValueError("meta.block_tables must be int32 with contiguous rows")
    for name in ("query_start_loc", "prefix_lens", "residual_slots"):
        if getattr(meta, name).dtype != torch.int32:
            raise ValueError(f"meta.{name} must be int32, got {getattr(meta, name).dtype}")


PREFILL_BLOCK_M = 128  # rows a tile: tokens x the G query heads of one KV head


def tile_rows(group: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """Rows of a prefill tile (tokens x G = `group` heads; at least 16, tl.dot's least)."""
    return max(block_m, 16, triton.next_power_of_2(group))


def tile_tokens(group: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """New tokens a tile of the prefill kernel holds for G = `group` query heads a KV head."""
    return tile_rows(group, block_m) // group


def launch_paged_attention(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                           block_m: int, block_n: int, num_warps: int, num_stages: int,
                           max_query_len: int, native_cvt: bool = False, causal_split: bool = False,
                           workspace: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Runs the prefill/extend kernel over every sequence; returns out [T, H, D], written into `out`
    when given (its dtype is the output's; a view with contiguous channels will do), else in q's
    dtype. `workspace`: the staged pages of `meta.stage` (fp16 [P, 2, KVH, BS, D],
    `prefix_stage.stage_prefix`), or None."""
    _check(cache, layer, q, k, v, meta)
    L = cache.layout
    T, H, D = q.shape
    G = H // L.kv_heads
    B = meta.num_seqs
    fmt = FMT_CODES[L.kv_dtype]
    unit = _unit(fmt)
    block_m = tile_rows(G, block_m)
    tok_per_tile = block_m // G
    n_tiles = triton.cdiv(max_query_len, tok_per_tile)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with contiguous channels, got {tuple(out.shape)}")
    res = cache.residual
    staged = workspace is not None
    tables = meta.stage.tables if staged else meta.block_tables
    page16 = 2 * L.kv_heads * L.block_size * D
    args = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, out_ptr=out, pool_ptr=cache.pool, res_ptr=res,
        query_start_ptr=meta.query_start_loc, prefix_lens_ptr=meta.prefix_lens,
        block_tables_ptr=meta.block_tables, residual_slots_ptr=meta.residual_slots,
        stage_ptr=workspace.view(torch.uint8) if staged else cache.pool, stage_tables_ptr=tables,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_vt=v.stride(0),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_bt=meta.block_tables.stride(0),
        page_stride=L.block_bytes // unit, layer_off=layer * L.layer_bytes // unit,
        slot_stride=res.stride(0), res_layer_off=layer * res.stride(1),
        tiles_ptr=meta.prefix_lens if meta.tiles is None else meta.tiles,
        stride_st=tables.stride(0), stage_page=page16, qk_scale=scale * LOG2E,
        V_OFF=L.v_data_offset // unit, KS_OFF=L.k_scale_offset, VS_OFF=L.v_scale_offset,
        FMT=fmt, HAS_SCALE=fmt in (FMT_E4M3, FMT_E5M2, FMT_INT8), KVH=L.kv_heads, G=G,
        BS=L.block_size, D=D, BLOCK_M=block_m, TOK_PER_TILE=tok_per_tile, BLOCK_N=block_n,
        DOT=_dot_dtype(fmt, q, staged), NATIVE=native_cvt, STAGE_V_OFF=page16 // 2, CAUSAL_SPLIT=causal_split,
        num_warps=num_warps, num_stages=num_stages)
    if meta.tiles is not None:  # a graph's fixed tile list (never staged)
        if staged:
            raise ValueError("a tile list's step reads its pages in place: no staged workspace")
        paged_attention_kernel[(int(meta.tiles.shape[0]) * L.kv_heads, 1, 1)](**args, STAGED=0, TILES=True)
        return out
    # a step that staged only some sequences runs two launches over disjoint rows, each kernel with
    # one page loop: the in-place loop's registers (250 for fp8, against 180) slowed the fp16 one
    for mode in ((1,) if meta.stage.every else (1, 2)) if staged else (0,):
        paged_attention_kernel[(n_tiles, B, L.kv_heads)](**args, STAGED=mode)
    return out
