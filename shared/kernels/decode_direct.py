"""Paged decode attention over 8-bit pages (fp8 e4m3 / e5m2, int8), every page loaded straight into
tensor-core operand registers (Gluon, Triton's layout-explicit dialect; GPU only).

Why: the plain Triton decode kernel (`decode_attention.py`) lets the compiler choose layouts: it
loads a tile coalesced, then moves it through shared memory into the MMA operand layout, byte by
byte for 8-bit codes (~190 shared-memory loads and ~240 address multiplies per warp per 128-token
tile, ~1,030 instructions in all), so halving the bytes halved only the memory time (1.0-1.15x
SDPA). Here each thread loads exactly the bytes its MMA fragments hold, 16 bytes at a time, and
converts them in registers: no shared memory, no barriers, 267 (fp8) or 328 (int8) instructions
per 16-token chunk per warp, and the pages stream at 96-99 % of the read bandwidth (docs/kernels.md).

How the bytes land in the fragments (mma.m16n8k16, one warp per program, 16-token chunks):
`mma_fragments.py`. Scores are transposed, S^T = K . q^T: q^T (the B operand [D, 8], the G <= 8
query heads of the KV head) takes 16 registers (G 9-16: [D, 16], two n-tiles, NH = 16, 224
registers uncapped or 168 capped, `wide_register_cap`: 1.38-1.58x SDPA at 64 query / 4 KV heads
against the plain kernel's 0.88-1.09x, H200), and S^T's accumulator has the heads where
O^T = V^T . P^T keeps them, so the softmax statistics need no layout change; P^T moves into the B
operand by a few warp shuffles. The output is un-permuted when stored.

Scales: the page's (fp8) or each token's (int8) K scale multiplies the scores; the V scale rides on
p, times the format's largest code C (p * s * C = p * absmax stays in fp16's normal range), and the
output is divided by C at the end. Full pages need no masks; the residual tail and the new token
(full precision) are one more 16-token chunk, masked (fp8: the last split takes it while its first
chunk loads, `PageLoads.tail_first`). The next chunk's loads are in flight while a
chunk is computed (pages carried as 32-bit words: as bytes, each would take a register). fp8 pages
are read with K in whole 32-byte sectors, one inline-asm pack of vector loads per operand with an
L2 prefetch-size hint, and the grid launches a sequence's KV heads side by side; 8-bit page loads
allocate no L1 line, since each byte is read once (`PageLoads`). Splits
write partials like the plain kernel's; up to FUSED_MAX_SPLITS the last split of each (sequence,
KV head) reduces them (a counter per pair), beyond that `reduce_splits_kernel` does.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kvmesh.kernels.formats import FMT_CODES, FMT_E4M3, FMT_E5M2, FMT_INT8
from kvmesh.kernels.split_partials import FUSED_MAX_SPLITS, launch_direct
from kvmesh.kernels.splits import num_sms, num_splits
from kvmesh.kernels.work_list import BatchContexts

from kvmesh.kernels.mma_fragments import CHUNK, HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from kvmesh.kernels.mma_fragments import (A_OP, B_OP, CHUNK_C, MMA, codes_fp16, k_layout, load_words,
                                              k_logical, k_operand, q_operand, tail_rows, to_fp16, v_layout,
                                              v_operand)
    from kvmesh.kernels.split_partials import store_output, work_unit
FORMATS = (FMT_E4M3, FMT_E5M2, FMT_INT8)
CODE_MAX = {FMT_E4M3: 448.0, FMT_E5M2: 57344.0, FMT_INT8: 127.0}


class Availability:
    """Whether the Gluon kernel compiles with the installed Triton: the first compile failure (a
    Triton whose Gluon API moved) turns it off for the process with one warning, and decode runs
    the plain kernel."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def disable(self, error: Exception) -> None:
        logging.getLogger(__name__).warning("direct decode kernel off (%s: %s); the plain Triton kernel "
                                            "serves 8-bit pages", type(error).__name__, str(error)[:200])
        self.error = error


AVAILABILITY = Availability()
COMPILE_ERRORS: tuple[type[Exception], ...] = ()
try:
    from triton.compiler.errors import CompilationError
    COMPILE_ERRORS = (CompilationError,)
except ImportError:  # pragma: no cover
    pass


def supports(fmt: int, q: torch.Tensor, residual_dtype: torch.dtype, group: int, head_dim: int,
             block_size: int) -> bool:
    """Whether this kernel serves the case (else the plain Triton kernel does): 8-bit pages, an fp16
    or bf16 model (q, new K/V and residual tails in that dtype), G <= 16 query heads per KV head (the
    columns of one or two MMA n-tiles), 16-token chunks, sm_89+ (the e4m3 pair conversion)."""
    return (HAVE_GLUON and AVAILABILITY.error is None and q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
            and fmt in FORMATS
            and q.dtype in (torch.float16, torch.bfloat16) and residual_dtype == q.dtype and 1 <= group <= 16
            and head_dim in (64, 128, 256) and block_size % CHUNK == 0
            and torch.cuda.get_device_capability(q.device) >= (8, 9))


if HAVE_GLUON:
    @gluon.jit
    def _step(acc, m_i, l_i, st, vt, vs):
        """One online-softmax step: st = S^T [16 tokens, 8 heads] scaled (and masked) scores in base
        2, vt the V^T A operand, vs the V scale(s) times the code maximum; acc: O^T [D, 8] fp32."""
        m_new = gl.maximum(m_i, gl.max(st, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(st - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        pt = gl.convert_layout((p * vs).to(gl.float16), B_OP)
        return mma_v2(vt, pt, acc * alpha[None, :]), m_new, l_i

    @gluon.jit
    def _chunk(acc, m_i, l_i, q_op, kcorr, kf, vf, ks, vs, qk_scale, valid, MASK: gl.constexpr,
               OFFSET: gl.constexpr, D: gl.constexpr, KSEC: gl.constexpr):
        """One 16-token chunk, K and V as fp16 [16, D] in memory channel order (k_layout, v_layout);
        ks / vs: the K scale(s), the V scale(s) times the code maximum (scalars, or [16, 1] per
        token); valid: [16] tokens that count (MASK). OFFSET: the key codes carry +1152 and kcorr
        [16, 8] = 1152 x each head's sum of q comes off the raw scores. (The same for values, 1152 x
        the sum of the weights off the output, cancels too much: 2e-2 relative error at 32k random
        tokens, whose average value is near zero.)"""
        st = mma_v2(k_operand(kf, D, KSEC), q_op, gl.zeros([CHUNK_C, q_op.shape[1]], gl.float32, layout=MMA))
        if OFFSET:
            st = st - kcorr
        st = st * (ks * qk_scale)
        if MASK:
            st = gl.where(valid[:, None], st, float("-inf"))
        return _step(acc, m_i, l_i, st, v_operand(vf, D), vs)

    @gluon.jit
    def _tail(acc, m_i, l_i, q_op, kcorr, k_new, v_new, res_k, n_tail, tk, ck, tv, cv, qk_scale, CMAX: gl.constexpr,
              KVH: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, BF16: gl.constexpr, KSEC: gl.constexpr):
        """The residual tail (n_tail tokens at res_k, full precision) and the new token (k_new / v_new
        [D]) into the state, in masked 16-token chunks."""
        for t0 in range(0, n_tail + 1, CHUNK_C):
            kf, vf, fk, fv = tail_rows(k_new, v_new, res_k, t0, n_tail, tk, ck, tv, cv, KVH, BS, D, BF16)
            valid = (t0 + gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, MMA))) <= n_tail
            acc, m_i, l_i = _chunk(acc, m_i, l_i, q_op, kcorr, kf, vf, fk, CMAX * fv, qk_scale, valid, True, False,
                                   D, KSEC)
        return acc, m_i, l_i

    @gluon.jit
    def _load_chunk(pool_ptr, bt_row, chunk, kvh, page_stride, layer_off, ko, vo, KS_OFF: gl.constexpr,
                    VS_OFF: gl.constexpr, FMT: gl.constexpr, BS: gl.constexpr, D: gl.constexpr,
                    KSEC: gl.constexpr, L2PF: gl.constexpr, L1NA: gl.constexpr):
        """Codes (uint32 words [16, D/4], K in k_layout, V in v_layout) and scales of one 16-token
        chunk of a page: fp32 scalars (fp8, the page's) or fp32 [16, 1] per token (int8). ko / vo:
        the loop-invariant word offsets of the thread's K and V words inside a page's layer region
        (one 64-bit page pointer a chunk: each load costs one address at most)."""
        CPP: gl.constexpr = BS // CHUNK_C
        page = gl.maximum(gl.load(bt_row + chunk // CPP), 0).to(gl.int64)  # -1 (never read) -> 0
        pb = pool_ptr + (page * page_stride + layer_off)
        p32 = pb.to(gl.pointer_type(gl.uint32), bitcast=True)
        r0 = kvh * BS
        if CPP > 1:  # the chunk's rows inside the page
            r = (chunk % CPP) * CHUNK_C
            r0 = r0 + r
            kb = load_words(p32 + (ko + r * (D // 4)), D, False, KSEC, L2PF, L1NA % 2 == 1)
            vb = load_words(p32 + (vo + r * (D // 4)), D, True, KSEC, L2PF, L1NA >= 2)
        else:
            kb = load_words(p32 + ko, D, False, KSEC, L2PF, L1NA % 2 == 1)  # L1NA: 1 K, 2 V, 3 both
            vb = load_words(p32 + vo, D, True, KSEC, L2PF, L1NA >= 2)
        if FMT == 5:  # per token, along the rows of S^T
            ps = pb.to(gl.pointer_type(gl.float16), bitcast=True)
            t = r0 + gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, MMA))
            ks = gl.load(ps + (KS_OFF // 2 + t)).to(gl.float32)[:, None]
            vs = gl.load(ps + (VS_OFF // 2 + t)).to(gl.float32)[:, None]
        else:
            ps = pb.to(gl.pointer_type(gl.float32), bitcast=True)
            ks = gl.load(ps + (KS_OFF // 4 + kvh))
            vs = gl.load(ps + (VS_OFF // 4 + kvh))
        return kb, vb, ks, vs

    @gluon.jit(do_not_specialize=["num_splits"])
    def decode_direct_kernel(
        q_ptr,  # fp16 or bf16 [B, H, D] new queries
        k_ptr,  # [B, KVH, D] new keys (q's dtype)
        v_ptr,  # [B, KVH, D] new values
        out_ptr,  # [B, H, D] output (q's dtype; PARTIAL == False, or FUSED)
        part_out_ptr,  # fp32 [B, H, splits, D] normalized partial outputs (PARTIAL; WORK: [U, H, D])
        part_lse_ptr,  # fp32 [B, H, splits] log2-sum-exp of each partial (PARTIAL; WORK: [U, H])
        count_ptr,  # int32 [>= B * KVH] zeros: splits done per (sequence, KV head) (FUSED; reset to 0)
        pool_ptr,  # uint8 [num_pages, page_bytes]
        res_ptr,  # [num_slots, layers, 2, KVH, BS, D] residual tails (q's dtype)
        prefix_lens_ptr,  # int32 [B]
        block_tables_ptr,  # int32 [B, max_pages]
        residual_slots_ptr,  # int32 [B]
        stride_qb, stride_qh, stride_kb, stride_vb, stride_ob, stride_oh, stride_bt,
        page_stride,  # bytes between pages
        layer_off,  # layer * layer_bytes
        slot_stride, res_layer_off,  # residual elements between slots; layer offset inside a slot
        qk_scale,  # softmax scale * log2(e)
        num_splits,  # programs per (sequence, KV head) along the chunks (WORK: the longest sequence's)
        work_ptr,  # int32 [U] a ragged batch's units (WORK; work_list.py)
        g_rows,  # = G, at run time: see the q load
        V_OFF: gl.constexpr, KS_OFF: gl.constexpr, VS_OFF: gl.constexpr, FMT: gl.constexpr,
        KVH: gl.constexpr, G: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, PARTIAL: gl.constexpr,
        CMAX: gl.constexpr,  # the format's largest code: V scales ride on p times it
        FUSED: gl.constexpr,  # the last split of each (sequence, KV head) reduces the partials
        BF16: gl.constexpr,  # a bf16 model (q, new K/V, residual and output in bf16)
        RMAX: gl.constexpr = 4,  # FUSED: partials the reduction unrolls over (a power of two >= splits)
        KSEC: gl.constexpr = False,  # K loads in whole 32-byte sectors (mma_fragments.k_layout)
        L2PF: gl.constexpr = 0,  # page loads ask L2 for this many bytes around them (0: plain loads)
        HEADS_FIRST: gl.constexpr = False,  # grid (KVH, B, splits): a sequence's heads are launched together
        TAIL_FIRST: gl.constexpr = False,  # the last split takes its tail while its first chunk loads
        NH: gl.constexpr = 8,  # the MMAs' head columns: 8 (G <= 8) or 16 (G <= 16: two n-tiles)
        L1NA: gl.constexpr = 0,  # page loads that allocate no L1 line (each byte is read once): 1 K, 2 V, 3 both
        WORK: gl.constexpr = False,  # grid (units, KVH, 1) over work_ptr; partials [U, H, D]
    ):
        LK: gl.constexpr = k_layout(D, False, KSEC)
        LV: gl.constexpr = v_layout(D, False)
        LKW: gl.constexpr = k_layout(D, True, KSEC)
        LVW: gl.constexpr = v_layout(D, True)
        # per head of the KV group / per token of a chunk, where the score orientation keeps them
        HL: gl.constexpr = gl.SliceLayout(0, MMA)  # [NH] per query head of the group
        TL: gl.constexpr = gl.SliceLayout(1, MMA)  # [16] per token of a chunk
        u = gl.program_id(1) if HEADS_FIRST else gl.program_id(0)
        kvh = gl.program_id(0) if HEADS_FIRST else gl.program_id(1)
        b, split, n_split = work_unit(work_ptr, u, num_splits, WORK)
        prefix = gl.load(prefix_lens_ptr + b)
        slot = gl.load(residual_slots_ptr + b).to(gl.int64)  # the residual tail's (read by the last split)
        res_k = res_ptr + slot * slot_stride + res_layer_off + kvh * BS * D
        k_new = k_ptr + b.to(gl.int64) * stride_kb + kvh * D
        v_new = v_ptr + b.to(gl.int64) * stride_vb + kvh * D
        tk = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, LK))
        ck = gl.arange(0, D, layout=gl.SliceLayout(0, LK))
        tv = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, LV))
        cv = gl.arange(0, D, layout=gl.SliceLayout(0, LV))
        tkw = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, LKW))
        wk = gl.arange(0, D // 4, layout=gl.SliceLayout(0, LKW))
        tvw = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, LVW))
        wv = gl.arange(0, D // 4, layout=gl.SliceLayout(0, LVW))

        # q^T [D, NH]: the G query heads of this KV head in logical channel order, once. The mask
        # uses G at run time: a mask the compiler can fold makes the padding constant zeros, and an
        # MMA operand with constants in it is rebuilt by register copies at every use.
        q = gl.load(q_ptr + b.to(gl.int64) * stride_qb + ((kvh * G + tk) * stride_qh)[:, None] + ck[None, :],
                    mask=(tk < g_rows)[:, None], other=0.0)  # [16, D]
        if BF16:  # a bf16 model: q in fp16 times a power of two (exact), which joins the softmax scale
            q, fq = to_fp16(q, tk < g_rows)
            qk_scale = qk_scale * fq
        q_op = q_operand(k_logical(q, D, KSEC), NH)  # q^T [D, NH]
        OFFSET: gl.constexpr = FMT == 5  # int8 key codes decoded as code + 1152 (see codes_fp16)
        kcorr = 0.0
        if OFFSET:  # 1152 x sum of each head's q, through the same MMA as the scores: [16, NH]
            kcorr = mma_v2(gl.full([CHUNK_C, D], 1152.0, gl.float16, layout=A_OP), q_op,
                           gl.zeros([CHUNK_C, NH], gl.float32, layout=MMA))
        acc = gl.zeros([D, NH], gl.float32, layout=MMA)  # O^T, times CMAX
        m_i = gl.full([NH], -1.0e30, gl.float32, layout=HL)
        l_i = gl.zeros([NH], gl.float32, layout=HL)
        every = gl.full([CHUNK_C], 1, gl.int1, layout=TL)

        # 1. this split's chunks of full pages, the next chunk's loads in flight during each step
        n_chunks = prefix // BS * (BS // CHUNK_C)
        per_split = gl.cdiv(n_chunks, n_split)
        lo = split * per_split
        hi = gl.minimum(n_chunks, lo + per_split)
        bt_row = block_tables_ptr + b.to(gl.int64) * stride_bt
        ko = ((kvh * BS + tkw) * (D // 4))[:, None] + wk[None, :]  # loop-invariant word offsets in a page
        vo = V_OFF // 4 + ((kvh * BS + tvw) * (D // 4))[:, None] + wv[None, :]
        kb, vb, ks, vs = _load_chunk(pool_ptr, bt_row, gl.minimum(lo, gl.maximum(n_chunks - 1, 0)), kvh,
                                     page_stride, layer_off, ko, vo, KS_OFF, VS_OFF, FMT, BS, D, KSEC, L2PF, L1NA)
        if TAIL_FIRST:  # while the first chunk loads: the tail's round trips overlap the pages' first ones
            if split == n_split - 1:
                acc, m_i, l_i = _tail(acc, m_i, l_i, q_op, kcorr, k_new, v_new, res_k, prefix % BS, tk, ck, tv, cv,
                                      qk_scale, CMAX, KVH, BS, D, BF16, KSEC)
        for c in range(lo, hi):
            kb_n, vb_n, ks_n, vs_n = _load_chunk(pool_ptr, bt_row, gl.minimum(c + 1, hi - 1), kvh, page_stride,
                                                 layer_off, ko, vo, KS_OFF, VS_OFF, FMT, BS, D, KSEC, L2PF, L1NA)
            acc, m_i, l_i = _chunk(acc, m_i, l_i, q_op, kcorr, codes_fp16(kb, FMT, OFFSET),
                                   codes_fp16(vb, FMT, False), ks, vs * CMAX, qk_scale, every, False, OFFSET, D,
                                   KSEC)
            kb, vb, ks, vs = kb_n, vb_n, ks_n, vs_n

        # 2. the last split: residual tail (prefix % BS tokens, fp16) and the new token, masked
        if not TAIL_FIRST:
            if split == n_split - 1:
                acc, m_i, l_i = _tail(acc, m_i, l_i, q_op, kcorr, k_new, v_new, res_k, prefix % BS, tk, ck, tv, cv,
                                      qk_scale, CMAX, KVH, BS, D, BF16, KSEC)

        # 3. normalize, store (in memory channel order)
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        o = acc * gl.convert_layout(1.0 / (l_safe * CMAX), gl.SliceLayout(0, MMA))[None, :]  # [D, 8]
        store_output(o, l_i, m_i, out_ptr, part_out_ptr, part_lse_ptr, count_ptr, b, kvh, split, stride_ob,
                     stride_oh, num_splits, u, n_split, KVH, G, D, PARTIAL, FUSED, RMAX, WORK)


MAXNREG = 128  # 16 one-warp programs per SM (D <= 128); uncapped, int8's prefetching variant took 166


@dataclass(frozen=True)
class PageLoads:
    """How a program reads its pages (kernel constexprs KSEC, L2PF, HEADS_FIRST, TAIL_FIRST, L1NA)."""

    k_sectors: bool = True  # K loads in whole 32-byte sectors (mma_fragments.k_layout SEC)
    l2_prefetch: int = 128  # bytes L2 fetches around each page load (ld.global.L2::<n>B; 0: none)
    heads_first: bool = True  # grid (KVH, B, splits): a sequence's KV heads launched side by side
    tail_first: bool = True  # the last split reads its residual tail while its first chunk loads
    l1_no_allocate: int = 0  # page loads that allocate no L1 line (ld.global.L1::no_allocate): 1 K, 2 V, 3 both


# H200, two runs of benchmarks/decode_direct_sweep.py (docs/decode_direct.md): fp8 +0.3-1.3 % at three
# cases with all three; int8 with them -0.6-+0.2 % (its K sectors + hints alone spill and lose 1.5-4 %).
# The tail first: fp8 +0.5-0.7 % at three cases (equal at 256 x 1,024), int8 -0.7-1.5 % at two.
# L1 no-allocate (fourteenth session): fp8 +1.6-2.5 %, int8 +0.8-3.2 % at every case (the bytes are read
# once, by one warp). int8 gains it on its V loads (K alone: +-0.5 %), which as one pack spill 8 bytes
# under the 128 cap (sm90_build.SPILL_BUDGET)
LOADS = {FMT_E4M3: PageLoads(l1_no_allocate=3), FMT_E5M2: PageLoads(l1_no_allocate=3),
         FMT_INT8: PageLoads(False, 0, False, False, l1_no_allocate=3)}


def decode_direct(cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float, *,
                  splits: int | None = None, fused: bool | None = None, maxnreg: int | None = None,
                  loads: PageLoads | None = None, tail_first: bool | None = None) -> torch.Tensor:
    """out [B, H, D] for q [B, H, D] fp16 or bf16 (one new token per sequence; k/v [B, KVH, D] its new
    K/V) over 8-bit pages; `supports` must hold and the caller (`decode_attention`) has checked the
    arguments. `splits` overrides the split count (from shapes and the compiled kernel's residency),
    `fused` whether the last split reduces (None: up to FUSED_MAX_SPLITS splits), `maxnreg` the
    register cap, `loads` the format's entry in LOADS, `tail_first` whether the last split takes its
    tail before its pages (None: as `loads` says)."""
    fmt = FMT_CODES[cache.layout.kv_dtype]
    nh = head_columns(q.shape[1] // cache.layout.kv_heads)
    if maxnreg is None and nh == 16:
        cap = wide_register_cap(q.shape[0], cache.layout.kv_heads, meta.max_prefix_len + 1, num_sms(q.device),
                                meta.contexts)
    else:
        cap = maxnreg or (MAXNREG if q.shape[2] <= 128 else None)
    lo = loads or LOADS[fmt]
    return launch_direct(decode_direct_kernel, "direct", cache, layer, q, k, v, meta, scale, splits=splits,
                         fused=fused, maxnreg=cap, FMT=fmt, CMAX=CODE_MAX[fmt], KSEC=lo.k_sectors,
                         L2PF=lo.l2_prefetch, HEADS_FIRST=lo.heads_first and q.shape[0] < 65536,
                         TAIL_FIRST=lo.tail_first if tail_first is None else tail_first, NH=nh,
                         L1NA=lo.l1_no_allocate)


def head_columns(group: int) -> int:
    """The MMAs' head columns for G query heads a KV head: one n-tile of 8, or two."""
    return 8 if group <= 8 else 16


WIDE_RESIDENT = 8  # programs an SM at 16 head columns uncapped (224-228 registers: two warps a quarter)
WIDE_CAP = 168  # 12 programs an SM, 40-56 bytes of spills


def wide_register_cap(batch: int, kv_heads: int, max_context: int, sms: int,
                      contexts: BatchContexts | None = None) -> int | None:
    """The register cap at 16 head columns: none where the uncapped launch's splits still fuse (no
    second launch, no spills), else WIDE_CAP, whose half again as many programs keep more bytes in
    flight where a second launch reduces anyway. H200, 64 query / 4 KV heads (`decode_heads.py`):
    the cap gave e4m3 +14-16 % (int8 +1-2 %) at 16 x 16,384 and 8 x 32,768 (16 and 33 splits
    uncapped) and -6 to -9 % (int8 -7 to -19 %) at 64 x 4,096 and 256 x 1,024 (4 and 1)."""
    n = num_splits(batch, kv_heads, max_context, sms, WIDE_RESIDENT, CHUNK, contexts)
    return None if n <= FUSED_MAX_SPLITS else WIDE_CAP
