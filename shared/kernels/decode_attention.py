"""Paged decode attention (one new token per sequence) over the quantized KV pool: the entry point
and the plain Triton kernel.

`decode_attention` sends pages of fp16/bf16 models to the register-direct kernels where they serve
the case: 8-bit pages to `decode_direct.py` (1.80-1.93x SDPA on the H200, against 1.0-1.15x here), INT4
pages to `decode_int4_direct.py` (else to the tile kernel of `decode_int4.py`); this kernel serves
the rest (fp16/bf16/fp32 pages, G > 16 for 8-bit pages, the interpreter).

One program per (sequence, KV head, split) serves the G query heads of that KV head (padded to 16
rows, or G rows that Triton pads inside the dot), so every page is read once. Its split of the sequence's full pages is read
BLOCK_N tokens at a time through the block table and dequantized in registers (`_load_page_tile`);
the last split also takes the residual tail and the new token. With more than one split each
program writes a normalized partial + log2-sum-exp; up to FUSED_MAX_SPLITS splits the last of a
(sequence, KV head)'s programs to finish combines them (a counter in `splits.COUNTERS`), past it
`reduce_splits_kernel` does, in a second launch.

Decode is memory-bound, so what matters is bytes in flight and whole waves:
- K tiles are loaded without a mask (tokens past the split read pages of the table's first entry or
  page 0, always finite pool memory, and their scores are masked), so loads pipeline freely;
  V tiles and V scales keep the mask (0 * garbage must not reach the accumulator).
- The split count comes from shapes only (no host sync, fixed grid) and the compiled variant's
  residency: whole waves (a last wave 1/3 full cost a third of the time at 64 x 4096).
- fp16/bf16 pages load the last split's residual slot id and new K/V row with q (`tail_early`): a
  program's end then waits on one round trip, not two (+1.2-1.5 % at 256 x 1024).
- A sequence's KV heads launched side by side (they read the same pages at about the same time):
  always for bf16, for fp16 where one split's programs take more than a wave (+1 % at 256 x 1024).
- bf16 pages: p . v as one dot with p's lo bf16 part in the padding query rows (LO_ROWS: 168
  registers against two dots' 213), the launch picked by each variant's own waves (`decode_tiles.py`);
  fp16 pages take 128-token tiles at 5 stages where the whole launch fits one wave.
- Per-format tiles (`decode_tiles.TILES`) come from benchmarks/decode_sweep.py on the H200; int8 reads its codes
  as 32-bit words decoded into even/odd channel halves (`_split_tile`), which keeps Triton from
  gathering single bytes out of shared memory for the dot operands.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels import decode_direct, decode_int4_direct
from kvmesh.kernels.decode_int4 import decode_int4
from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.formats import FMT_BF16, FMT_CODES, FMT_INT4
from kvmesh.kernels.decode_tiles import (TILES, lo_rows_launch, one_wave_launch, past_one_wave_launch,
                                         plain_constexprs)
from kvmesh.kernels.split_partials import FUSED_MAX_SPLITS
from kvmesh.kernels.splits import COUNTERS, launch_split, num_sms, num_splits, resident_of
from kvmesh.kernels.splits import resident_programs  # noqa: F401 (re-exported for callers)
from kvmesh.kernels.paged_attention import (LOG2E, _cast_out, _check, _dot, _dot_dtype, _load_page_tile,
                                            _softmax_step, _unit)
from kvmesh.kernels.partials import combine_own_splits, partial_rows, work_unit
from kvmesh.kv.pool import KVCache


@triton.jit(do_not_specialize=["num_splits"])  # one compile for every split count
def decode_kernel(
    q_ptr,  # [B, H, D] new queries
    k_ptr,  # [B, KVH, D] new keys (full precision)
    v_ptr,  # [B, KVH, D] new values
    out_ptr,  # [B, H, D] output (PARTIAL == False, or FUSED)
    part_out_ptr,  # fp32 [B, H, splits, D] normalized partial outputs (PARTIAL; WORK: [U, H, D])
    part_lse_ptr,  # fp32 [B, H, splits] log2-sum-exp of each partial (PARTIAL; WORK: [U, H])
    count_ptr,  # int32 [>= B * KVH] zeros: splits done per (sequence, KV head) (FUSED; reset to 0)
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
    num_splits,  # programs per (sequence, KV head) along the pages (WORK: the longest sequence's)
    work_ptr,  # int32 [U] a ragged batch's units, b << 16 | split << 8 | splits of b (WORK; work_list.py)
    V_OFF: tl.constexpr, KS_OFF: tl.constexpr, VS_OFF: tl.constexpr,
    FMT: tl.constexpr, HAS_SCALE: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
    BS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PARTIAL: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr, SPLIT: tl.constexpr,
    ASM: tl.constexpr,
    HEADS_FIRST: tl.constexpr = False,  # grid (KVH, B, splits): a sequence's KV heads launched side by side
    TAIL_EARLY: tl.constexpr = False,  # SPLIT == 0: the tail's slot and new row loaded at the start
    LO_ROWS: tl.constexpr = False,  # bf16 pages, G <= BLOCK_H / 2: p's lo part in rows BLOCK_H / 2.. (_softmax_step)
    WORK: tl.constexpr = False,  # grid (units, KVH, 1) over work_ptr; partials [U, H, D]
    FUSED: tl.constexpr = False,  # PARTIAL: the last split to finish combines the partials
):
    u = tl.program_id(1) if HEADS_FIRST else tl.program_id(0)
    kvh = tl.program_id(0) if HEADS_FIRST else tl.program_id(1)
    b, split, n_split = work_unit(work_ptr, u, num_splits, WORK)
    prefix = tl.load(prefix_lens_ptr + b)
    r = tl.arange(0, BLOCK_H)
    if LO_ROWS:  # rows BLOCK_H / 2.. repeat the heads of rows 0..
        r = r % (BLOCK_H // 2)
    head = kvh * G + r  # [M] query heads of this KV head (rows >= G are padding)
    row_ok = r < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (head * stride_qh)[:, None] + d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT)  # [M, D]
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    m_i = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    if TAIL_EARLY:  # the tail's slot id and new K/V row load with q, not after the last page
        slot = tl.load(residual_slots_ptr + b).to(tl.int64)
        k_new = tl.load(k_ptr + b.to(tl.int64) * stride_kb + kvh * D + d)
        v_new = tl.load(v_ptr + b.to(tl.int64) * stride_vb + kvh * D + d)
        tl.debug_barrier()  # keeps the loads here, not sunk to their use
    if SPLIT > 0:  # 8-bit codes decoded as even/odd channel halves (see `_split_tile`)
        HD: tl.constexpr = D // 2
        c2 = tl.arange(0, HD)
        q_row = q_ptr + b.to(tl.int64) * stride_qb + (head * stride_qh)[:, None]
        q_e = tl.load(q_row + 2 * c2[None, :], mask=row_ok[:, None], other=0.0).to(DOT)
        q_o = tl.load(q_row + 2 * c2[None, :] + 1, mask=row_ok[:, None], other=0.0).to(DOT)
        acc_e = tl.zeros((BLOCK_H, HD), tl.float32)
        acc_o = tl.zeros((BLOCK_H, HD), tl.float32)

    # 1. this split's full pages, in whole tiles (per_split is a multiple of the tile's pages)
    PAGES: tl.constexpr = BLOCK_N // BS
    n_pages = prefix // BS
    per_split = tl.cdiv(tl.cdiv(n_pages, n_split), PAGES) * PAGES
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
        if SPLIT == 0:
            kt, ks = _load_page_tile(pool_ptr, base, tok, all_rows, kvh, 0, KS_OFF, True, FMT, BS, D,
                                     DOT, NATIVE)
            vt, vs = _load_page_tile(pool_ptr, base, tok, nm, kvh, V_OFF, VS_OFF, False, FMT, BS, D,
                                     DOT, NATIVE)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kt, ks, vt, vs, nm[None, :], qk_scale,
                                          HAS_SCALE, DOT, LO_ROWS)
        else:
            if SPLIT == 1:
                ke, ko = _split_tile(pool_ptr, base, tok, all_rows, kvh, 0, FMT, BS, D, ASM)
                ks = _token_scales(pool_ptr, base, tok, all_rows, kvh, KS_OFF, FMT, BS, ASM)
                s = _dot(q_e, tl.trans(ke.to(DOT)), DOT) + _dot(q_o, tl.trans(ko.to(DOT)), DOT)
            else:  # keys whole (their shared-memory reads are already wide), values split
                kt, ks = _load_page_tile(pool_ptr, base, tok, all_rows, kvh, 0, KS_OFF, True, FMT, BS, D,
                                         DOT, NATIVE)
                s = _dot(q, tl.trans(kt), DOT)
            ve, vo = _split_tile(pool_ptr, base, tok, nm, kvh, V_OFF, FMT, BS, D, ASM)
            vs = _token_scales(pool_ptr, base, tok, nm, kvh, VS_OFF, FMT, BS, ASM)
            acc_e, acc_o, m_i, l_i = _split_step(acc_e, acc_o, m_i, l_i, s, ks, ve, vo, vs, nm[None, :],
                                                 qk_scale, DOT)

    if split == n_split - 1:
        # 2. residual tail (prefix % BS tokens, full precision) and 3. the new token
        t = tl.arange(0, BS)
        n_tail = prefix % BS
        tm = t < n_tail
        is_new = (t == n_tail)[:, None]  # the new token joins the tail tile as row n_tail (< BS)
        valid = (t <= n_tail)[None, :]
        if not TAIL_EARLY:
            slot = tl.load(residual_slots_ptr + b).to(tl.int64)
        rk = res_ptr + slot * slot_stride + res_layer_off + ((kvh * BS + t) * D)[:, None]
        rv = rk + KVH * BS * D
        kn = k_ptr + b.to(tl.int64) * stride_kb + kvh * D
        vn = v_ptr + b.to(tl.int64) * stride_vb + kvh * D
        if SPLIT == 0:
            if not TAIL_EARLY:
                k_new = tl.load(kn + d)
                v_new = tl.load(vn + d)
            kt = tl.where(is_new, k_new[None, :], tl.load(rk + d[None, :], mask=tm[:, None], other=0.0))
            vt = tl.where(is_new, v_new[None, :], tl.load(rv + d[None, :], mask=tm[:, None], other=0.0))
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kt.to(DOT), kt, vt.to(DOT), vt, valid,
                                          qk_scale, False, DOT, LO_ROWS)
        else:
            ones = tl.full((BS,), 1.0, tl.float32)
            ce, co = 2 * c2, 2 * c2 + 1
            ke = tl.where(is_new, tl.load(kn + ce)[None, :], tl.load(rk + ce[None, :], mask=tm[:, None], other=0.0))
            ko = tl.where(is_new, tl.load(kn + co)[None, :], tl.load(rk + co[None, :], mask=tm[:, None], other=0.0))
            ve = tl.where(is_new, tl.load(vn + ce)[None, :], tl.load(rv + ce[None, :], mask=tm[:, None], other=0.0))
            vo = tl.where(is_new, tl.load(vn + co)[None, :], tl.load(rv + co[None, :], mask=tm[:, None], other=0.0))
            s = _dot(q_e, tl.trans(ke.to(DOT)), DOT) + _dot(q_o, tl.trans(ko.to(DOT)), DOT)
            acc_e, acc_o, m_i, l_i = _split_step(acc_e, acc_o, m_i, l_i, s, ones, ve, vo, ones, valid,
                                                 qk_scale, DOT)
    if SPLIT > 0:  # back to channel order: (m, j, 0) = channel 2j, (m, j, 1) = channel 2j + 1
        acc = tl.reshape(tl.join(acc_e, acc_o), (BLOCK_H, D))
    if LO_ROWS:  # each head's hi and lo sums added once; both halves carry the same max and sum
        HALF: tl.constexpr = BLOCK_H // 2
        acc = tl.sum(tl.reshape(acc, (2, HALF, D)), axis=0)  # [HALF, D]
        m_i = tl.max(tl.reshape(m_i, (2, HALF)), axis=0)
        l_i = tl.max(tl.reshape(l_i, (2, HALF)), axis=0)
        r = tl.arange(0, HALF)
        head = kvh * G + r
        row_ok = r < G

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if PARTIAL:
        pr = partial_rows(b, u, head, split, num_splits, KVH * G, WORK)  # [M]
        tl.store(part_out_ptr + (pr * D)[:, None] + d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + pr, lse, mask=row_ok)
        if FUSED:
            tl.debug_barrier()  # every thread's partial is written before the count says so
            done = tl.atomic_add(count_ptr + b * KVH + kvh, 1, sem="acq_rel", scope="gpu")
            if done == n_split - 1:
                o = combine_own_splits(part_out_ptr, part_lse_ptr, b, u - split, head, row_ok, d, n_split,
                                       num_splits, KVH * G, D, WORK)
                op = out_ptr + b.to(tl.int64) * stride_ob + (head * stride_oh)[:, None] + d[None, :]
                tl.store(op, _cast_out(o, out_ptr.dtype.element_ty), mask=row_ok[:, None])
                tl.store(count_ptr + b * KVH + kvh, 0)  # ready for the next launch
    else:
        op = out_ptr + b.to(tl.int64) * stride_ob + (head * stride_oh)[:, None] + d[None, :]
        tl.store(op, _cast_out(o, out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _split_tile(pool_ptr, base, tok, n_mask, head, DATA_OFF: tl.constexpr, FMT: tl.constexpr,
                BS: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr):
    """8-bit codes of one KV head read as 32-bit words (4 channels each) -> (even, odd channels)
    as fp16 [N, D // 2] each, decoded two at a time in 16-bit lanes. Splitting even/odd instead of
    interleaving keeps the decode in whole words (no byte gathers from shared memory); the dot
    products do not care about channel order (q is split the same way, and the output is
    re-interleaved once at the end). e4m3 by bit operations comes out as x * 2**-8 (the 256 is in the
    scale); with ASM (GPU only) e4m3 uses the hardware pair conversion and comes out exact."""
    W: tl.constexpr = D // 4
    w = tl.arange(0, W)
    row = (head * BS + tok).to(tl.int64)
    p32 = pool_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    x = tl.load(p32 + ((base + DATA_OFF) // 4 + row * W)[:, None] + w[None, :], mask=n_mask[:, None],
                other=0)  # [N, W]
    if ASM and FMT == 3:
        # bytes (0, 2) and (1, 3) of each word as e4m3x2 -> fp16x2 (low byte -> low half)
        e, o = tl.inline_asm_elementwise(
            asm="""{ .reg .b32 t0, t1; .reg .b16 h0, h1;
            prmt.b32 t0, $2, 0, 0x4420; prmt.b32 t1, $2, 0, 0x4431;
            cvt.u16.u32 h0, t0; cvt.u16.u32 h1, t1;
            cvt.rn.f16x2.e4m3x2 $0, h0; cvt.rn.f16x2.e4m3x2 $1, h1; }""",
            constraints="=r,=r,r", args=[x], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
        return _pairs_fp16(e), _pairs_fp16(o)
    return _lanes_fp16(x & 0x00FF00FF, FMT), _lanes_fp16((x >> 8) & 0x00FF00FF, FMT)


@triton.jit
def _pairs_fp16(f):
    """uint32 [N, W] of fp16 pairs -> fp16 [N, 2W] (low half first)."""
    return tl.reshape(tl.join((f & 0xFFFF).to(tl.uint16), (f >> 16).to(tl.uint16)),
                      (f.shape[0], 2 * f.shape[1])).to(tl.float16, bitcast=True)


@triton.jit
def _lanes_fp16(x, FMT: tl.constexpr):
    """uint32 [N, W] with codes in bits 0-7 and 16-23 -> fp16 [N, 2W] (low lane first)."""
    if FMT == 3:
        f = ((x & 0x00800080) << 8) | ((x & 0x007F007F) << 7)
    elif FMT == 4:
        f = x << 8
    else:  # int8: fp16(0x6400 | code ^ 0x80) = 1152 + x
        f = (x ^ 0x00800080) | 0x64006400
    y = _pairs_fp16(f)
    if FMT == 5:
        y = y - 1152.0
    return y


@triton.jit
def _token_scales(pool_ptr, base, tok, n_mask, head, SCALE_OFF: tl.constexpr, FMT: tl.constexpr,
                  BS: tl.constexpr, ASM: tl.constexpr):
    """[N] fp32 scale of each token's codes: the page's (fp8, times 256 for e4m3's bit decode) or
    the token's (int8)."""
    if FMT == 5:
        ps = pool_ptr.to(tl.pointer_type(tl.float16), bitcast=True)
        return tl.load(ps + (base + SCALE_OFF) // 2 + head * BS + tok, mask=n_mask, other=0.0).to(tl.float32)
    else:
        ps = pool_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
        s = tl.load(ps + (base + SCALE_OFF) // 4 + head, mask=n_mask, other=0.0)
        return s * 256.0 if FMT == 3 and not ASM else s


@triton.jit
def _split_step(acc_e, acc_o, m_i, l_i, s, ks, ve, vo, vs, valid, qk_scale, DOT: tl.constexpr):
    """`_softmax_step` given the raw scores s [M, N] fp32, values as even/odd channel halves (fp16
    tiles [N, D // 2]) and per-token K and V scales."""
    s = tl.where(valid, s * (ks * qk_scale)[None, :], float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_max = tl.maximum(tl.max(vs, axis=0), 1e-30)
    pv = (p * (vs / v_max)[None, :]).to(DOT)
    acc_e = acc_e * alpha[:, None] + _dot(pv, ve.to(DOT), DOT) * v_max
    acc_o = acc_o * alpha[:, None] + _dot(pv, vo.to(DOT), DOT) * v_max
    return acc_e, acc_o, m_new, l_i


def decode_attention(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata, scale: float, *, splits: int | None = None,
                     block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                     programs_per_sm: int = 0, native_cvt: bool | None = None,
                     split_codes: int | None = None, block_h: int | None = None,
                     maxnreg: int | None = None, direct: bool | None = None,
                     heads_first: bool | None = None, tail_early: bool | None = None,
                     lo_rows: bool | None = None, fused: bool | None = None) -> torch.Tensor:
    """out [B, H, D] for q [B, H, D] (one new token per sequence, k/v [B, KVH, D] its new K/V).
    None takes the format's entry in TILES. `native_cvt` converts fp8/int8 with the hardware
    instructions instead of bit operations; `split_codes` reads 8-bit codes as 32-bit words decoded
    into even/odd channel halves (1: K and V, 2: V only); `programs_per_sm` replaces the residency
    read from the compiled kernel in the split count; `block_h` sets the query rows of a program
    (G padded to 16, or G itself where Triton pads the dot); `maxnreg` caps registers per thread.
    8-bit pages go to the register-direct Gluon kernel (`decode_direct.py`) where it serves the case
    (`direct=None`); `direct=False` forces this kernel, `direct=True` requires the other (a
    ValueError says why where it cannot serve); `heads_first` launches a sequence's KV heads side by side
    (this kernel; None: the format's choice, fp16 heads first only where one split takes more than a
    wave); `tail_early` loads the last split's residual slot id and new K/V row with q, so no
    load waits after the last page (fp16/bf16 by default); `lo_rows` (bf16 pages, G <= 8) computes p . v
    as one dot with p's lo part in the padding query rows (None: `decode_tiles.lo_rows_launch` decides);
    `fused` whether this kernel's last split combines the partials (None: up to FUSED_MAX_SPLITS)."""
    if meta.max_query_len != 1 or q.shape[0] != meta.num_seqs:
        raise ValueError(f"decode needs one new token per sequence: max_query_len={meta.max_query_len}, "
                         f"T={q.shape[0]}, B={meta.num_seqs}")
    _check(cache, layer, q, k, v, meta)
    L = cache.layout
    B, H, D = q.shape
    G = H // L.kv_heads
    fmt = FMT_CODES[L.kv_dtype]
    if fmt == FMT_INT4:  # register-direct where it serves the case, else the tile kernel (decode_int4.py)
        if (direct is not False and k.dtype == q.dtype
                and decode_int4_direct.supports(q, cache.residual.dtype, G, D, L.block_size)):
            try:
                return decode_int4_direct.decode_int4_direct(cache, layer, q, k, v, meta, scale, splits=splits)
            except decode_direct.COMPILE_ERRORS as e:  # another Triton's Gluon: the tile kernel serves
                if direct:
                    raise
                decode_direct.AVAILABILITY.disable(e)
        if direct:
            raise ValueError(f"the direct decode kernel does not serve kv int4, q {q.dtype}, G={G}, D={D}")
        return decode_int4(cache, layer, q, k, v, meta, scale, splits=splits, programs_per_sm=programs_per_sm)
    if direct is not False:
        if decode_direct.supports(fmt, q, cache.residual.dtype, G, D, L.block_size) and k.dtype == q.dtype:
            try:
                return decode_direct.decode_direct(cache, layer, q, k, v, meta, scale, splits=splits,
                                                   maxnreg=maxnreg)
            except decode_direct.COMPILE_ERRORS as e:  # another Triton's Gluon: the plain kernel serves
                if direct:
                    raise
                decode_direct.AVAILABILITY.disable(e)
        if direct:
            raise ValueError(f"the direct decode kernel does not serve kv {L.kv_dtype}, q {q.dtype}, G={G}, "
                             f"D={D}, block size {L.block_size} here")
    tiles = TILES[fmt]
    consts, own_tile, llama_shape = plain_constexprs(
        L, G, _dot_dtype(fmt, q), block_n=block_n, num_stages=num_stages, block_h=block_h, native_cvt=native_cvt,
        split_codes=split_codes, heads_first=heads_first, tail_early=tail_early, lo_rows=lo_rows, maxnreg=maxnreg,
        num_warps=num_warps)
    block_n, block_h = consts["BLOCK_N"], consts["BLOCK_H"]
    unit = _unit(fmt)
    out = torch.empty_like(q)
    res = cache.residual
    counters = COUNTERS.get(q.device, B * L.kv_heads) if fused is not False else None
    args = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, out_ptr=out, pool_ptr=cache.pool, res_ptr=res,
        count_ptr=counters if counters is not None else meta.prefix_lens,
        prefix_lens_ptr=meta.prefix_lens, block_tables_ptr=meta.block_tables,
        residual_slots_ptr=meta.residual_slots,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_kb=k.stride(0), stride_vb=v.stride(0),
        stride_ob=out.stride(0), stride_oh=out.stride(1), stride_bt=meta.block_tables.stride(0),
        page_stride=L.block_bytes // unit, layer_off=layer * L.layer_bytes // unit,
        slot_stride=res.stride(0), res_layer_off=layer * res.stride(1), qk_scale=scale * LOG2E, **consts)
    args["HEADS_FIRST"] = consts["HEADS_FIRST"] and B < 65536  # grid y and z stay under 65,536
    if splits is None:
        def resident_in(a: dict) -> int:
            return programs_per_sm or resident_of("plain", decode_kernel, a, q.device)
        sms = num_sms(q.device)
        resident = resident_in(args)
        contexts = meta.contexts  # a ragged batch: split in proportion to each context (work_list.py)
        splits = num_splits(B, L.kv_heads, meta.max_prefix_len + 1, sms, resident, block_n, contexts)
        past_one_wave = splits == 1 and B * L.kv_heads > sms * resident
        if heads_first is None and tiles.heads_first_past_one_wave and llama_shape and past_one_wave:
            args["HEADS_FIRST"] = B < 65536
        if lo_rows is None and tiles.lo_rows_deep_stages and own_tile and llama_shape and 2 * G <= block_h:
            args, splits = lo_rows_launch(args, splits, tiles.lo_rows_deep_stages, B, L.kv_heads,
                                          meta.max_prefix_len + 1, sms, block_n, resident_in, contexts)
        if tiles.one_wave and own_tile and llama_shape and maxnreg is None:  # (a cap the caller set stays)
            args, splits = one_wave_launch(args, splits, tiles.one_wave, B, L.kv_heads, meta.max_prefix_len + 1,
                                           sms, resident_in, contexts)
        # bf16 over lo rows only (its two dots at 64 x 2 measured 0.918x SDPA at 256 x 1,024)
        if (tiles.past_one_wave and own_tile and llama_shape and maxnreg is None
                and (fmt != FMT_BF16 or args["LO_ROWS"])):
            args, splits = past_one_wave_launch(args, splits, tiles.past_one_wave, B, L.kv_heads,
                                                meta.max_prefix_len + 1, sms, resident_in, contexts)
    args["FUSED"] = counters is not None and 1 < splits and (fused or splits <= FUSED_MAX_SPLITS)
    return launch_split(decode_kernel, out, L.kv_heads, splits, args, meta.contexts, meta.work)
