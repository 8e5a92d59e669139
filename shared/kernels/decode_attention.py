"""Paged decode attention (one new token per sequence) over the quantized KV pool.

One program per (sequence, KV head, split) serves the G query heads of that KV head (padded to 16
rows for tl.dot), so every page is read once. Its split of the sequence's full pages is read
BLOCK_N tokens at a time through the block table and dequantized in registers (`_load_page_tile`);
the last split also takes the residual tail and the new token. With more than one split each
program writes a normalized partial + log2-sum-exp and `reduce_splits_kernel` combines them.

Decode is memory-bound, so what matters is bytes in flight and whole waves:
- K tiles are loaded without a mask (tokens past the split read pages of the table's first entry or
  page 0, always finite pool memory, and their scores are masked), so loads pipeline freely;
  V tiles and V scales keep the mask (0 * garbage must not reach the accumulator).
- The split count comes from shapes only (no host sync, fixed grid): enough programs for several
  waves of the GPU (a last wave 1/3 full cost 35 % at 64 x 4096 with one split).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.formats import FMT_CODES, FMT_E4M3, FMT_E5M2, FMT_INT8
from kvmesh.kernels.paged_attention import (LOG2E, _cast_out, _check, _dot_dtype, _load_page_tile,
                                            _softmax_step, _unit, reduce_splits_kernel)
from kvmesh.kv.pool import KVCache

NUM_SMS_DEFAULT = 132  # H200; the real count is read from the device when there is one
PROGRAMS_PER_SM = 8  # programs wanted per SM over the whole launch (several waves)
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism
MAX_SPLITS = 64


@triton.jit(do_not_specialize=["num_splits"])  # one compile for every split count
def decode_kernel(
    q_ptr,  # [B, H, D] new queries
    k_ptr,  # [B, KVH, D] new keys (full precision)
    v_ptr,  # [B, KVH, D] new values
    out_ptr,  # [B, H, D] output (PARTIAL == False)
    part_out_ptr,  # fp32 [B, H, splits, D] normalized partial outputs (PARTIAL)
    part_lse_ptr,  # fp32 [B, H, splits] log2-sum-exp of each partial (PARTIAL)
    pool_ptr,  # uint8 [num_pages, page_bytes]
    res_ptr,  # [num_slots, layers, 2, KVH, BS, D] residual tails
    prefix_lens_ptr,  # int32 [B]
    block_tables_ptr,  # int32 [B, max_pages]
    residual_slots_ptr,  # int32 [B]
    stride_qb, stride_qh, stride_kb, stride_vb, stride_ob, stride_oh, stride_bt,
    page_stride,  # units (see paged_attention._unit) between pages
    layer_off,  # layer * layer_bytes, in units
    slot_stride, res_layer_off,  # residual elements between slots; layer offset inside a slot
    qk_scale,  # softmax scale * log2(e)
    num_splits,  # programs per (sequence, KV head) along the pages
    V_OFF: tl.constexpr, KS_OFF: tl.constexpr, VS_OFF: tl.constexpr,
    FMT: tl.constexpr, HAS_SCALE: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
    BS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PARTIAL: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    prefix = tl.load(prefix_lens_ptr + b)
    r = tl.arange(0, BLOCK_H)
    head = kvh * G + r  # [M] query heads of this KV head (rows >= G are padding)
    row_ok = r < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (head * stride_qh)[:, None] + d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT)  # [M, D]
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    m_i = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)

    # 1. this split's full pages, in whole tiles (per_split is a multiple of the tile's pages)
    PAGES: tl.constexpr = BLOCK_N // BS
    n_pages = prefix // BS
    per_split = tl.cdiv(tl.cdiv(n_pages, num_splits), PAGES) * PAGES
    p_lo = split * per_split
    n_end = tl.minimum(n_pages, p_lo + per_split) * BS
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    all_rows = tl.full((BLOCK_N,), 1, tl.int1)
    for n0 in range(p_lo * BS, n_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < n_end
        page = tl.load(bt_row + n // BS, mask=nm, other=0).to(tl.int64)
        base = page * page_stride + layer_off  # [N] offset of the page's layer (in units)
        tok = n % BS
        kt, ks = _load_page_tile(pool_ptr, base, tok, all_rows, kvh, 0, KS_OFF, True, FMT, BS, D,
                                 DOT, NATIVE)
        vt, vs = _load_page_tile(pool_ptr, base, tok, nm, kvh, V_OFF, VS_OFF, False, FMT, BS, D, DOT,
                                 NATIVE)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kt, ks, vt, vs, nm[None, :], qk_scale,
                                      HAS_SCALE, DOT)

    if split == num_splits - 1:
        # 2. residual tail (prefix % BS tokens, full precision) and 3. the new token
        t = tl.arange(0, BS)
        n_tail = prefix % BS
        tm = t < n_tail
        slot = tl.load(residual_slots_ptr + b).to(tl.int64)
        rk = res_ptr + slot * slot_stride + res_layer_off + ((kvh * BS + t) * D)[:, None] + d[None, :]
        kt = tl.load(rk, mask=tm[:, None], other=0.0)
        vt = tl.load(rk + KVH * BS * D, mask=tm[:, None], other=0.0)
        # the new token joins the tail tile as row n_tail (< BS always)
        is_new = (t == n_tail)[:, None]
        kn = tl.load(k_ptr + b.to(tl.int64) * stride_kb + kvh * D + d)
        vn = tl.load(v_ptr + b.to(tl.int64) * stride_vb + kvh * D + d)
        kt = tl.where(is_new, kn[None, :].to(kt.dtype), kt).to(DOT)
        vt = tl.where(is_new, vn[None, :].to(vt.dtype), vt).to(DOT)
        valid = (t <= n_tail)[None, :]
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kt, kt, vt, vt, valid, qk_scale, False, DOT)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if PARTIAL:
        ph = b.to(tl.int64) * (KVH * G) + head  # [M] row of [B, H]
        tl.store(part_out_ptr + ((ph * num_splits + split) * D)[:, None] + d[None, :], o,
                 mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + ph * num_splits + split, lse, mask=row_ok)
    else:
        op = out_ptr + b.to(tl.int64) * stride_ob + (head * stride_oh)[:, None] + d[None, :]
        tl.store(op, _cast_out(o, out_ptr.dtype.element_ty), mask=row_ok[:, None])


def num_splits(batch: int, kv_heads: int, max_context: int, num_sms: int,
               programs_per_sm: int = PROGRAMS_PER_SM, block_n: int = 64) -> int:
    """Splits per (sequence, KV head): enough programs for `programs_per_sm` per SM (several waves,
    so the last, partial wave costs little), each with at least MIN_TOKENS_PER_SPLIT tokens."""
    programs = batch * kv_heads
    want = triton.cdiv(programs_per_sm * num_sms, programs)
    cap = max(1, max_context // max(MIN_TOKENS_PER_SPLIT, block_n))
    return max(1, min(want, cap, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


def decode_attention(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata, scale: float, *, splits: int | None = None,
                     block_n: int | None = None, num_warps: int = 4, num_stages: int = 3,
                     programs_per_sm: int = PROGRAMS_PER_SM, native_cvt: bool = False,
                     maxnreg: int | None = None) -> torch.Tensor:
    """out [B, H, D] for q [B, H, D] (one new token per sequence, k/v [B, KVH, D] its new K/V).
    The keyword arguments override the defaults (benchmarks, tests): `native_cvt` converts fp8/int8
    with the hardware instructions instead of bit operations; `maxnreg` caps registers per thread."""
    if meta.max_query_len != 1 or q.shape[0] != meta.num_seqs:
        raise ValueError(f"decode needs one new token per sequence: max_query_len={meta.max_query_len}, "
                         f"T={q.shape[0]}, B={meta.num_seqs}")
    _check(cache, layer, q, k, v, meta)
    L = cache.layout
    B, H, D = q.shape
    G = H // L.kv_heads
    if block_n is None:
        block_n = max(64, L.block_size)
    if block_n % L.block_size:
        raise ValueError(f"block_n must be a multiple of the block size {L.block_size}, got {block_n}")
    if splits is None:
        splits = num_splits(B, L.kv_heads, meta.max_prefix_len + 1, _num_sms(q.device),
                            programs_per_sm, block_n)
    fmt = FMT_CODES[L.kv_dtype]
    unit = _unit(fmt)
    out = torch.empty_like(q)
    if splits > 1:
        part_out = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    res = cache.residual
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    decode_kernel[(B, L.kv_heads, splits)](
        q_ptr=q, k_ptr=k, v_ptr=v, out_ptr=out, part_out_ptr=part_out, part_lse_ptr=part_lse,
        pool_ptr=cache.pool, res_ptr=res, prefix_lens_ptr=meta.prefix_lens,
        block_tables_ptr=meta.block_tables, residual_slots_ptr=meta.residual_slots,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_kb=k.stride(0), stride_vb=v.stride(0),
        stride_ob=out.stride(0), stride_oh=out.stride(1), stride_bt=meta.block_tables.stride(0),
        page_stride=L.block_bytes // unit, layer_off=layer * L.layer_bytes // unit,
        slot_stride=res.stride(0), res_layer_off=layer * res.stride(1),
        qk_scale=scale * LOG2E, num_splits=splits,
        V_OFF=L.v_data_offset // unit, KS_OFF=L.k_scale_offset, VS_OFF=L.v_scale_offset,
        FMT=fmt, HAS_SCALE=fmt in (FMT_E4M3, FMT_E5M2, FMT_INT8), KVH=L.kv_heads, G=G,
        BS=L.block_size, D=D, BLOCK_H=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
        PARTIAL=splits > 1, DOT=_dot_dtype(fmt, q), NATIVE=native_cvt,
        num_warps=num_warps, num_stages=num_stages, **extra,
    )
    if splits > 1:
        reduce_splits_kernel[(B, H)](
            part_out_ptr=part_out, part_lse_ptr=part_lse, out_ptr=out,
            stride_ot=out.stride(0), stride_oh=out.stride(1),
            H=H, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), D=D, num_warps=4)
    return out
