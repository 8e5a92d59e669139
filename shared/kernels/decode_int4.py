"""Paged decode attention over INT4 pages (v2 format, `kv/layout.py`) with the scales folded out of
the tiles: the K and V nibbles go into the dots as exact fp16 integers and no element is ever
multiplied by its (s, m).

Keys, per channel c over a page: k = (n - 7.5) * s_c (symmetric), so
    q . k = (q * s) . n - 7.5 * sum(q * s),   q * s = [G, D] once per page
(the offset from the same rounded q * s the dot takes, so the two parts cancel as they should).
Values, per token t and 32-channel group g:
    sum_t p_t v_t[group g] = sum_t (p_t * s_tg) n_t[group g] + sum_t p_t m_tg
so the scales ride on p (one multiply per token and group) and the m part is one [G, BS] x [BS, D/32]
dot per page. q * s and p * s are normalized by the page's largest s code (the 8-bit path does the
same with v_max): fp16 keeps its precision whatever the scale's size; the page scale multiplies the
fp32 dot result.

Nibbles become fp16 by integer ops, four lanes of a 32-bit word at a time: ((w >> 4k) & 0x000F000F) |
0x64006400 holds channels k and k + 4 of the word's eight as 1024 + n. Channel order inside each
word's eight is thus bit-reversed (position p holds channel rev3(p)); q and the K s codes are read in
that order, the output is stored through it, and dots do not care.

A program (sequence, KV head, split) runs PAGES independent page streams side by side, one page of
each per step (the tile's batch dimension; stream j takes pages j, j + PAGES, ...), each with its own
running max and sum, merged once at the end: no cross-warp reduction inside the loop. The last split
then adds the residual tail and the new token. Splits and their reduction as in decode_attention.py.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.formats import FMT_INT4
from kvmesh.kernels.int4_codec import HEADER, K_OFFSET, code_slot
from kvmesh.kernels.paged_attention import LOG2E, _cast_out, _check, _dot_dtype
from kvmesh.kernels.partials import partial_rows, work_unit
from kvmesh.kernels.splits import launch_split, num_sms, num_splits, resident_of
from kvmesh.kv.pool import KVCache

# Defaults from the sm_90 compile (triton 3.6): one page stream of one warp issues the fewest
# instructions per token; benchmarks/int4_gpu_check.py times the others
PAGES = 1  # page streams per program (one page each per step, one warp each)
NUM_WARPS = 1
NUM_STAGES = 2  # Triton software pipelining of the page loads
MAXNREG = 168  # 1 warp: 244 -> 168 registers without spills (8 -> 12 programs per SM), loop +7 % instructions


@triton.jit
def _rev3(p):
    """Channel at decoded position p: the low 3 bits reversed (see the module docstring)."""
    return (p & -8) | ((p & 1) << 2) | (p & 2) | ((p >> 2) & 1)


@triton.jit
def _header(pool_ptr, byte, valid):
    """bf16 (m_base, m_step, s_step) at 8-aligned byte offsets [P] -> fp32 [P] each (0 where not valid)."""
    h = tl.load(pool_ptr.to(tl.pointer_type(tl.uint64), bitcast=True) + byte // 8, mask=valid, other=0)
    m_base = (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    m_step = ((h >> 16).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    s_step = ((h >> 32).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return m_base, m_step, s_step


@triton.jit
def _nibbles(w, DOT: tl.constexpr, ASM: tl.constexpr):
    """uint32 words [P, R, W] of 8 nibbles -> [P, R, 8W] in DOT, exact, position p of each eight holding
    channel rev3(p): lanes (k, k + 4) of ((w >> 4k) & 0x000F000F) | 0x64006400, as fp16 1024 + n.
    ASM (GPU): one lop3 and one sub.f16x2 a pair, the halves taken straight from the 32-bit register
    (Triton's own split of a word into two fp16 costs a PRMT each)."""
    M: tl.constexpr = 0x000F000F
    B: tl.constexpr = 0x64006400
    P: tl.constexpr = w.shape[0]
    R: tl.constexpr = w.shape[1]
    W: tl.constexpr = w.shape[2]
    if ASM:
        k4 = tl.arange(0, 4)[None, None, None, :] * 4  # [1, 1, 1, 4] shift of lane pair k
        lo, hi = tl.inline_asm_elementwise(
            asm="""{ .reg .b32 t, c; shr.b32 t, $2, $3; mov.b32 c, 0x64006400;
            lop3.b32 t, t, 0x000F000F, c, 0xEA; sub.rn.f16x2 t, t, c; mov.b32 {$0, $1}, t; }""",
            constraints="=h,=h,r,r", args=[tl.broadcast_to(w[:, :, :, None], (P, R, W, 4)), k4.to(tl.uint32)],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        # [P, R, W, k, half]: channel k + 4 half = position 2k + half: rev3 of that is not this order,
        # so the positions are regrouped to (a, b, half) with k = a + 2b (see module docstring)
        x = tl.reshape(tl.permute(tl.reshape(tl.join(lo, hi), (P, R, W, 2, 2, 2)), (0, 1, 2, 4, 3, 5)), (P, R, 8 * W))
        return x.to(DOT)
    f = tl.join(tl.join((w & M) | B, ((w >> 4) & M) | B), tl.join(((w >> 8) & M) | B, ((w >> 12) & M) | B))
    h = tl.join((f & 0xFFFF).to(tl.uint16), (f >> 16).to(tl.uint16))  # [P, R, W, 2, 2, 2]
    x = tl.reshape(h, (P, R, 8 * W)).to(tl.float16, bitcast=True) - 1024.0
    return x.to(DOT)


@triton.jit
def _code(c, DOT: tl.constexpr, C: tl.constexpr):
    """8-bit codes -> c / C in DOT, exact, by bits (no I2F): fp16(0x4400 | c) = 4 + c / 256 (C = 256),
    fp16(0x6400 | c) = 1024 + c (C = 1)."""
    B: tl.constexpr = 0x4400 if C == 256 else 0x6400
    x = (c.to(tl.uint16) | B).to(tl.float16, bitcast=True) - (4.0 if C == 256 else 1024.0)
    return x.to(DOT)


@triton.jit(do_not_specialize=["num_splits"])  # one compile for every split count
def decode_int4_kernel(
    q_ptr,  # [B, H, D] new queries
    k_ptr,  # [B, KVH, D] new keys (full precision)
    v_ptr,  # [B, KVH, D] new values
    out_ptr,  # [B, H, D] output (PARTIAL == False)
    part_out_ptr,  # fp32 [B, H, splits, D] normalized partial outputs (PARTIAL; WORK: [U, H, D])
    part_lse_ptr,  # fp32 [B, H, splits] log2-sum-exp of each partial (PARTIAL; WORK: [U, H])
    pool_ptr,  # uint8 [num_pages, page_bytes]
    res_ptr,  # [num_slots, layers, 2, KVH, BS, D] residual tails
    prefix_lens_ptr,  # int32 [B]
    block_tables_ptr,  # int32 [B, max_pages]
    residual_slots_ptr,  # int32 [B]
    stride_qb, stride_qh, stride_kb, stride_vb, stride_ob, stride_oh, stride_bt,
    page_stride,  # bytes between pages
    layer_off,  # layer * layer_bytes
    slot_stride, res_layer_off,  # residual elements between slots; layer offset inside a slot
    qk_scale,  # softmax scale * log2(e)
    num_splits,  # programs per (sequence, KV head) along the pages (WORK: the longest sequence's)
    work_ptr,  # int32 [U] a ragged batch's units (WORK; work_list.py)
    V_OFF: tl.constexpr, KS_OFF: tl.constexpr, VS_OFF: tl.constexpr,
    KVH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
    PAGES: tl.constexpr, PARTIAL: tl.constexpr, DOT: tl.constexpr,
    ASM: tl.constexpr,  # GPU: the nibble decode in inline PTX (the interpreter runs none)
    WORK: tl.constexpr = False,  # grid (units, KVH, 1) over work_ptr; partials [U, H, D]
):
    u = tl.program_id(0)
    kvh = tl.program_id(1)
    b, split, n_split = work_unit(work_ptr, u, num_splits, WORK)
    NG: tl.constexpr = D // 32
    W: tl.constexpr = D // 8
    prefix = tl.load(prefix_lens_ptr + b)
    r = tl.arange(0, BLOCK_H)
    head = kvh * G + r  # [H] query heads of this KV head (rows >= G are padding)
    row_ok = r < G
    dp = tl.arange(0, D)  # decoded position
    dc = _rev3(dp)  # its channel
    q_row = q_ptr + b.to(tl.int64) * stride_qb + (head * stride_qh)[:, None]
    qp = tl.load(q_row + dc[None, :], mask=row_ok[:, None], other=0.0).to(DOT)  # [H, D] permuted
    rec_off = KS_OFF + kvh * (HEADER + D)  # this head's K record inside a page's layer

    # page streams: state [P, H]; V accumulators per group [NG, P, H, 32] and the m part [P, H, NG]
    acc = tl.zeros((NG, PAGES, BLOCK_H, 32), tl.float32)
    acc_m = tl.zeros((PAGES, BLOCK_H, NG), tl.float32)
    m_i = tl.full((PAGES, BLOCK_H), -1.0e30, tl.float32)
    l_i = tl.zeros((PAGES, BLOCK_H), tl.float32)

    n_pages = prefix // BS
    per_split = tl.cdiv(tl.cdiv(n_pages, n_split), PAGES) * PAGES
    p_lo = split * per_split
    p_end = tl.minimum(n_pages, p_lo + per_split)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    j = tl.arange(0, PAGES)
    t = tl.arange(0, BS)
    w = tl.arange(0, W)
    g = tl.arange(0, NG)
    for p0 in range(p_lo, p_end, PAGES):
        pv = p0 + j < p_end  # [P] stream has a page this step
        page = tl.load(bt_row + p0 + j, mask=pv, other=0).to(tl.int64)
        base = page * page_stride + layer_off  # [P] bytes
        rec = base + rec_off
        # keys: words [P, BS, W] (unmasked: a missing page reads page 0, finite, and is masked below)
        p32 = pool_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
        kw = tl.load(p32 + (base // 4 + (kvh * BS) * W)[:, None, None] + (t * W)[None, :, None] + w[None, None, :])
        _, _, k_ss = _header(pool_ptr, rec, pv)
        kcs = _code(tl.load(pool_ptr + (rec + HEADER)[:, None] + code_slot(dc)[None, :]), DOT, 256)  # [P, D] s / 256, permuted
        qs = qp[None, :, :] * kcs[:, None, :]  # [P, H, D]: q * s / (256 s_step), |.| <= |q|
        s = tl.dot(qs, tl.permute(_nibbles(kw, DOT, ASM), (0, 2, 1)))  # [P, H, BS]
        s = (s - K_OFFSET * tl.sum(qs.to(tl.float32), axis=2)[:, :, None]) * (k_ss * (256.0 * qk_scale))[:, None, None]
        s = tl.where(pv[:, None, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=2))  # [P, H]
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, :, None])  # [P, H, BS]
        l_i = l_i * alpha + tl.sum(p, axis=2)
        m_i = m_new
        # values: words [P, BS, W], (s, m) codes [P, BS, 2, NG] per token and group
        vw = tl.load(p32 + ((base + V_OFF) // 4 + (kvh * BS) * W)[:, None, None] + (t * W)[None, :, None]
                     + w[None, None, :])
        v_mb, v_ms, v_ss = _header(pool_ptr, rec + 8, pv)
        vc = (base + VS_OFF + kvh * BS * 2 * NG)[:, None, None] + (t * (2 * NG))[None, :, None] + g[None, None, :]
        vcs = tl.permute(_code(tl.load(pool_ptr + vc), tl.float32, 256), (2, 0, 1))  # [NG, P, BS] s / 256
        vcm = _code(tl.load(pool_ptr + vc + NG), DOT, 1)  # [P, BS, NG]
        ps = (p[None, :, :, :] * vcs[:, :, None, :]).to(DOT)  # [NG, P, H, BS]: batch g * P + p, warp = page
        vt = tl.permute(tl.reshape(_nibbles(vw, DOT, ASM), (PAGES, BS, NG, 32)), (2, 0, 1, 3))  # [NG, P, BS, 32]
        pv_dot = tl.dot(tl.reshape(ps, (NG * PAGES, BLOCK_H, BS)), tl.reshape(vt, (NG * PAGES, BS, 32)))
        acc = acc * alpha[None, :, :, None] + tl.reshape(pv_dot, (NG, PAGES, BLOCK_H, 32)) * (
            v_ss * 256.0)[None, :, None, None]
        pm = tl.dot(p.to(DOT), vcm)  # [P, H, NG]: p . cm
        acc_m = acc_m * alpha[:, :, None] + v_ms[:, None, None] * pm + (v_mb[:, None] * tl.sum(p, axis=2))[:, :, None]

    # merge the page streams: [H] state, out [H, D] in decoded positions
    m_run = tl.max(m_i, axis=0)
    wgt = tl.math.exp2(m_i - m_run[None, :])  # [P, H]
    l_run = tl.sum(l_i * wgt, axis=0)
    o3 = tl.sum(acc * wgt[None, :, :, None], axis=1) + tl.permute(tl.sum(acc_m * wgt[:, :, None], axis=0), (1, 0))[:, :, None]
    o = tl.reshape(tl.permute(o3, (1, 0, 2)), (BLOCK_H, D))  # [NG, H, 32] -> [H, D]

    if split == n_split - 1:
        # residual tail (prefix % BS tokens, full precision) and the new token as row n_tail, permuted
        n_tail = prefix % BS
        tm = t < n_tail
        is_new = (t == n_tail)[:, None]
        slot = tl.load(residual_slots_ptr + b).to(tl.int64)
        rk = res_ptr + slot * slot_stride + res_layer_off + ((kvh * BS + t) * D)[:, None] + dc[None, :]
        kt = tl.where(is_new, tl.load(k_ptr + b.to(tl.int64) * stride_kb + kvh * D + dc)[None, :],
                      tl.load(rk, mask=tm[:, None], other=0.0))
        vt = tl.where(is_new, tl.load(v_ptr + b.to(tl.int64) * stride_vb + kvh * D + dc)[None, :],
                      tl.load(rk + KVH * BS * D, mask=tm[:, None], other=0.0))
        s = tl.dot(qp, tl.trans(kt.to(DOT))) * qk_scale  # [H, BS]
        s = tl.where((t <= n_tail)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_run - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_run = l_run * alpha + tl.sum(p, axis=1)
        o = o * alpha[:, None] + tl.dot(p.to(DOT), vt.to(DOT))
        m_run = m_new

    l_safe = tl.where(l_run > 0.0, l_run, 1.0)
    o = o / l_safe[:, None]
    if PARTIAL:
        pr = partial_rows(b, u, head, split, num_splits, KVH * G, WORK)  # [H]
        tl.store(part_out_ptr + (pr * D)[:, None] + dc[None, :], o, mask=row_ok[:, None])
        lse = tl.where(l_run > 0.0, m_run + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + pr, lse, mask=row_ok)
    else:
        op = out_ptr + b.to(tl.int64) * stride_ob + (head * stride_oh)[:, None] + dc[None, :]
        tl.store(op, _cast_out(o, out_ptr.dtype.element_ty), mask=row_ok[:, None])


def decode_int4(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, splits: int | None = None, pages: int | None = None,
                asm: bool | None = None, num_warps: int | None = None, num_stages: int | None = None,
                maxnreg: int | None = -1, programs_per_sm: int = 0) -> torch.Tensor:
    """out [B, H, D] for q [B, H, D] over an int4 cache (one new token per sequence, k/v [B, KVH, D]
    its new K/V). `pages`: page streams per program; `asm`: the nibble decode in inline PTX (GPU
    only); `maxnreg` caps registers per thread (-1: MAXNREG for the default tile, None: no cap);
    None takes the module defaults. `splits` None: from shapes and the compiled variant's
    residency (num_splits), no host sync; `programs_per_sm` replaces that residency."""
    pages = pages or PAGES
    num_warps = num_warps or NUM_WARPS
    num_stages = NUM_STAGES if num_stages is None else num_stages
    if maxnreg == -1:
        maxnreg = MAXNREG if (pages, num_warps) == (PAGES, NUM_WARPS) else None
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    asm = not interpret if asm is None else asm and not interpret
    if meta.max_query_len != 1 or q.shape[0] != meta.num_seqs:
        raise ValueError(f"decode needs one new token per sequence: max_query_len={meta.max_query_len}, "
                         f"T={q.shape[0]}, B={meta.num_seqs}")
    _check(cache, layer, q, k, v, meta)
    L = cache.layout
    if L.kv_dtype != "int4":
        raise ValueError(f"decode_int4 needs an int4 cache, got {L.kv_dtype}")
    B, H, D = q.shape
    G = H // L.kv_heads
    if pages < 1 or pages & (pages - 1):
        raise ValueError(f"pages must be a power of two, got {pages}")
    out = torch.empty_like(q)
    res = cache.residual
    args = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, out_ptr=out, pool_ptr=cache.pool, res_ptr=res,
        prefix_lens_ptr=meta.prefix_lens, block_tables_ptr=meta.block_tables,
        residual_slots_ptr=meta.residual_slots,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_kb=k.stride(0), stride_vb=v.stride(0),
        stride_ob=out.stride(0), stride_oh=out.stride(1), stride_bt=meta.block_tables.stride(0),
        page_stride=L.block_bytes, layer_off=layer * L.layer_bytes,
        slot_stride=res.stride(0), res_layer_off=layer * res.stride(1), qk_scale=scale * LOG2E,
        V_OFF=L.v_data_offset, KS_OFF=L.k_scale_offset, VS_OFF=L.v_scale_offset,
        KVH=L.kv_heads, G=G, BS=L.block_size, D=D, BLOCK_H=triton.next_power_of_2(G), PAGES=pages,
        DOT=_dot_dtype(FMT_INT4, q), ASM=asm, num_warps=num_warps, num_stages=num_stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}))
    if splits is None:
        resident = programs_per_sm or resident_of("int4", decode_int4_kernel, args, q.device)
        splits = num_splits(B, L.kv_heads, meta.max_prefix_len + 1, num_sms(q.device), resident,
                            pages * L.block_size, meta.contexts)
    return launch_split(decode_int4_kernel, out, L.kv_heads, splits, args, meta.contexts, meta.work)
