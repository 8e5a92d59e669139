"""Paged decode attention over INT4 pages, every page loaded straight into tensor-core operand
registers (Gluon; GPU only): the register-direct design of `decode_direct.py` carried to 4-bit
codes, with the scales folded out of the elements wherever the math allows.

Keys (symmetric per channel c over the page: k = (n - 7.5) s_c, s_c = cs_c s_step):
    q . k_t = s_step (q * cs) . n_t - 7.5 s_step (q . cs)
q * cs is the page's B operand: q' = q 2**e (a power of two that brings max |q| to 2**13-2**14) times
the code as the fp16 subnormal c 2**-24 (one byte permute and one multiply a pair; the record stores
each eight's codes as channels 0 1 4 5 2 3 6 7, so a word holds the (c, c + 4) pairs it takes), a
normal number rounded once; the nibbles enter the MMA as fp16 subnormals n 2**-24 (one mask a pair,
no conversion; the units join the scale: the H200's tensor cores take subnormal inputs exactly).
The offset q . m (m = -7.5 s), the same for every token of a page, comes 16 pages at a time from one
MMA over their s codes against q, at the top of every 16 pages, into shared memory; a chunk loads its
page's row.
Values (per token t and 32-channel group: v = n s_t + m_t): the thread's channels lie in one group,
so n s_t comes out of one fma a pair ((1024 + n) s - 1024 s, from the fp16 bit trick; odd channels,
whose nibble sits 4 bits up, as 16 n s, the 16 taken off their output rows once), in units of
a per-page power of two F that keeps s near 1/8 (F's changes ride on the softmax rescale, as a
difference of exponent fields); the codes of a token pair come in one 16-byte load and two byte
permutes. The m part, m_step sum_t p_t cm_t + m_base sum_t p_t, is one small MMA over the code
bytes (exact integers) whose rows 8-15 are ones, so it yields the softmax sum sum_t p_t too (no
shuffles); fp32 accumulators, added to the output at the end.

Loads at head_dim 128, G <= 8: a cp.async ring in shared memory (`int4_page_loads.ring_*`), RING
chunks deep: each chunk copies the four page runs of the chunk RING - 1 ahead (16 bytes a lane a
copy), then reads its own slot into the fragments where they are used, so no registers wait on
loads (106-108 under a 128 cap: 16 programs an SM where the register loads held 12) and no line is
asked of L2 twice. Elsewhere (head_dim 64 and 256, G 9-16), register loads: the next chunk's keys
are issued once this chunk's scores are done and its values once its values are, into the registers
just freed (a whole chunk ahead they need a second set, and ptxas copies every word once a chunk), a
thread's K (and V) words as one pack of vector loads at immediate
offsets from one address, allocating no L1 line (each byte is read once); L2 is asked for the chunk
after that (one prefetch a lane), so those loads find it there. What stays the same through the loop
and is read once a chunk (the q' pairs, sum(q'), the 16 pages' offsets) waits in shared memory, not
in registers: 140 registers instead of 166, so ptxas has the room to issue the next chunk's loads
before the softmax (under register pressure it sank them below it, and the keys then had only the
values part as cover).

The steps over a chunk: `int4_chunk.py`; fragments, layouts and the PTX: `int4_fragments.py`.
Splits, the fused split reduction, the residual tail (full precision, one masked chunk) and the new
token as in `decode_direct.py`. SASS, timings and every variant measured: docs/decode_direct.md,
"INT4" (2.58-2.73x SDPA on the H200). G 9-16 query heads a KV head take two MMA n-tiles (NH 16: q^T
[D, 16], S^T [16, 16], O^T [D, 16]; the q' pairs of heads 8-15 in the shared buffers' second half);
see ROUTED_GROUP.
"""
from __future__ import annotations

import os

import torch

from kvmesh.kernels.decode_direct import AVAILABILITY, head_columns  # one switch for the Gluon kernels
from kvmesh.kernels.int4_codec import HEADER  # bytes of the K and V headers of each head's K record
from kvmesh.kernels.mma_fragments import CHUNK, HAVE_GLUON
from kvmesh.kernels.split_partials import launch_direct

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from kvmesh.kernels.int4_chunk import chunk_scores, page_offsets, residual_tail, softmax_values
    from kvmesh.kernels.int4_fragments import (b_operand, logical_k, logical_k_fp16, odd_rows_unit, pair_words,
                                               q_pairs, row_halves, rows_joined, v_codes_layout, v_words_layout,
                                               words_layout)
    from kvmesh.kernels.int4_page_loads import (load_keys, load_values, ring_buffers, ring_issue, ring_keys,
                                                ring_offsets, ring_values, ring_wait)
    from kvmesh.kernels.mma_fragments import A_OP, CHUNK_C, MMA, load_hint, q_operand, to_fp16
    from kvmesh.kernels.split_partials import chunk_lines, page_base, prefetch_l2, store_output, work_unit

MAXNREG = 168  # a ceiling: at head_dim 128 the kernel takes 140 (still 12 one-warp programs per SM:
# registers go by SM quarter, `splits.resident_programs`)
# or 16 at 128 registers (no spills, but ptxas then issues the next chunk's loads after the softmax:
# chunks ~6 % slower, H200): taken where 12 a SM would leave a part-full last wave (256 x 1,024)
REGISTER_OPTIONS = ((MAXNREG, 1.0), (128, 1.06))
# head_dim 64 (SmolLM2) takes 112 under this cap, no spills: 16 programs an SM everywhere
REGISTER_CAP_D64 = 128
# Head_dim 128 at G <= 8: the pages come through a cp.async ring in shared memory, RING chunks deep, and
# no registers wait on loads: 106-108 registers under a 128 cap (sm_90, no spills), 10.5 KB of shared
# memory, 16 programs an SM, no L2 prefetch. H200 against the register loads (two runs):
# 2.57-2.61 / 2.54-2.58 / 2.66-2.75 / 2.55-2.61x SDPA against 2.53-2.56 / 2.48-2.52 / 2.55-2.59 / 2.53-2.56x.
# 4 deep (13 KB, still 16 programs an SM) -1 to -3 %, more in flight and slower; 3 deep at 96
# registers (20 an SM) spills: -8 to -12 %; 4 deep at 168 (12 an SM): -1 to -15 %.
RING = 3
RING_REGISTER_CAP = 128


# G 9-16 take two MMA n-tiles (NH 16: 221-226 registers uncapped at head_dim 128, no spills, 469
# instructions a chunk against 350, sm_90): 1.69-1.82x SDPA at 64 query heads over 4 KV heads against the
# tile kernel's 0.48-0.63x (H200, benchmarks/decode_heads.py); larger groups go to the tile kernel
ROUTED_GROUP = 16


def supports(q: torch.Tensor, residual_dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> bool:
    """Whether this kernel serves the case (else `decode_int4.py` does): an fp16 or bf16 model, G <=
    ROUTED_GROUP query heads per KV head, 16-token chunks, head_dim 64-256."""
    return (HAVE_GLUON and AVAILABILITY.error is None and q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
            and q.dtype in (torch.float16, torch.bfloat16) and residual_dtype == q.dtype
            and 1 <= group <= ROUTED_GROUP
            and head_dim in (64, 128, 256) and block_size % CHUNK == 0
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


if HAVE_GLUON:
    @gluon.jit
    def _as_rows_36(buf, shape: gl.constexpr):
        return buf._reinterpret(gl.float32, shape, gl.SwizzledSharedLayout(1, 1, 1, [0]))

    @gluon.jit
    def _as_rows_39(buf, shape: gl.constexpr):
        return buf.reinterpret(gl.float32, shape, gl.SwizzledSharedLayout(1, 1, 1, [0]))

    # a shared buffer's bytes as rows of a rank-1 layout; the method lost its underscore in Triton 3.9
    _as_rows = _as_rows_39 if hasattr(gl.shared_memory_descriptor, "reinterpret") else _as_rows_36

    @gluon.jit(do_not_specialize=["num_splits"])
    def decode_int4_direct_kernel(
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
        g_rows,  # = G, at run time (see decode_direct's q load)
        V_OFF: gl.constexpr, KS_OFF: gl.constexpr, VS_OFF: gl.constexpr,
        KVH: gl.constexpr, G: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, PARTIAL: gl.constexpr,
        FUSED: gl.constexpr, BF16: gl.constexpr,
        L2PF: gl.constexpr,  # ask L2 for chunk c + 2 while chunk c + 1 loads
        RMAX: gl.constexpr = 4,  # FUSED: partials the reduction unrolls over (a power of two >= splits)
        TAIL_FIRST: gl.constexpr = False,  # the last split takes its tail while its first chunk loads
        L1NA: gl.constexpr = False,  # the K and V row loads allocate no L1 line (each byte is read once)
        NH: gl.constexpr = 8,  # the MMAs' head columns: 8 (G <= 8) or 16 (G <= 16: two n-tiles)
        RING: gl.constexpr = 0,  # > 0: pages through a cp.async ring of RING chunks (head_dim 128, NH 8 only)
        WORK: gl.constexpr = False,  # grid (units, KVH, 1) over work_ptr; partials [U, H, D]
    ):
        USE_RING: gl.constexpr = RING > 0 and D == 128 and NH == 8
        LKW: gl.constexpr = words_layout(D // 8, 16)
        LVW: gl.constexpr = v_words_layout(D)
        LCB: gl.constexpr = words_layout(D // 4, 8)
        LCQ: gl.constexpr = words_layout(D // 4, NH)  # the q' pair words of the NH head rows
        LQ: gl.constexpr = words_layout(D, 16)
        HL: gl.constexpr = gl.SliceLayout(0, MMA)  # [NH] per query head of the group
        u = gl.program_id(0)
        kvh = gl.program_id(1)
        b, split, n_split = work_unit(work_ptr, u, num_splits, WORK)
        prefix = gl.load(prefix_lens_ptr + b)
        slot = gl.load(residual_slots_ptr + b).to(gl.int64)  # the residual tail's (read by the last split)
        res_k = res_ptr + slot * slot_stride + res_layer_off + kvh * BS * D
        k_new = k_ptr + b.to(gl.int64) * stride_kb + kvh * D
        v_new = v_ptr + b.to(gl.int64) * stride_vb + kvh * D
        tk = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, LKW))
        wk = gl.arange(0, D // 8, layout=gl.SliceLayout(0, LKW))
        tv = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, LVW))
        wv = gl.arange(0, D // 8, layout=gl.SliceLayout(0, LVW))
        rc = gl.arange(0, 8, layout=gl.SliceLayout(1, LCB))
        wc = gl.arange(0, D // 4, layout=gl.SliceLayout(0, LCB))
        LVC: gl.constexpr = v_codes_layout()
        tp = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, LVC)))
        gm = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LVC)))
        kc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LVC)))
        tq = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, LQ))
        cq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))

        # q' = q 2**e with 1/16 on odd channels (their nibbles decode 16x), B operand [D, 8]; sq = sum(q')
        q_rows = q_ptr + b.to(gl.int64) * stride_qb + ((kvh * G + tq) * stride_qh)[:, None] + cq[None, :]
        q = gl.load(q_rows, mask=(tq < g_rows)[:, None], other=0.0).to(gl.float32)  # [16, D]
        if BF16:
            qf, fq = to_fp16(q, tq < g_rows)
            q = qf.to(gl.float32)
            qk_scale = qk_scale * fq
        # 2**e brings max |q| into [2**13, 2**14): q' times a K s code c as the fp16 subnormal c 2**-24
        # (< 2**-16) then stays a normal number, rounded once, and no code needs its offset taken off
        e_q = gl.maximum((gl.max(gl.max(gl.abs(q), axis=1), axis=0).to(gl.int32, bitcast=True) >> 23) & 0xFF, 80)
        q = q * ((267 - e_q) << 23).to(gl.float32, bitcast=True)  # 2**e, e = 140 - e_q
        qk_q = qk_scale * ((e_q - 13) << 23).to(gl.float32, bitcast=True)  # the pages' scores: 2**-e
        k_unit = qk_q * 281474976710656.0  # 2**48: the nibbles' and the codes' 2**-24
        qp = gl.where((cq % 2 == 1)[None, :], q * 0.0625, q).to(gl.float16)
        qp_op = q_operand(logical_k_fp16(qp, D), NH)
        # q' as fp16 pairs in the K s codes' words (see scaled_code_pairs); the loop's B operands
        q8 = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(qp.to(gl.float32), [2, 8, D]), [1, 2, 0]), [8, D, 2]),
                               gl.BlockedLayout([1, D // 4, 2], [8, 4, 1], [1, 1, 1], [2, 1, 0]))
        q8, q8_hi = gl.split(q8)  # heads 0-7 and 8-15 (padding at NH 8)
        ql, qh = pair_words(q8)
        # q' pairs, sum(q') and the pages' offsets wait in shared memory, read where they are used:
        # held in registers through the loop (24 of them), they left ptxas too few to issue the next
        # chunk's loads before this chunk's softmax, so those loads had only the values part as cover
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])  # 16-byte units, rows apart: no conflicts
        q_lo = gl.allocate_shared_memory(gl.uint32, [NH, D // 4], SMEM)
        q_hi = gl.allocate_shared_memory(gl.uint32, [NH, D // 4], SMEM)
        q_lo.slice(0, 8).store(gl.convert_layout(ql, LCB))
        q_hi.slice(0, 8).store(gl.convert_layout(qh, LCB))
        if NH == 16:
            ql2, qh2 = pair_words(q8_hi)
            q_lo.slice(8, 8).store(gl.convert_layout(ql2, LCB))
            q_hi.slice(8, 8).store(gl.convert_layout(qh2, LCB))
        ones = gl.where((cq % 2 == 1)[None, :], 16.0, 1.0).to(gl.float16) + gl.zeros([CHUNK_C, D], gl.float16, LQ)
        ones_op = gl.convert_layout(logical_k_fp16(ones, D), A_OP, assert_trivial=True)
        sq = mma_v2(ones_op, qp_op, gl.zeros([CHUNK_C, NH], gl.float32, layout=MMA))  # [16, NH]: sum(q)
        ROWS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        sq_s = gl.allocate_shared_memory(gl.float32, [CHUNK_C, NH], ROWS, sq)

        acc = gl.zeros([D, NH], gl.float32, layout=MMA)  # O^T of the n s part, x F
        accm, l_i = row_halves(gl.zeros([CHUNK_C, NH], gl.float32, layout=MMA))  # [8 g, NH]: m_step sum p cm
        mb = gl.zeros_like(l_i)  # m_base sum p (l_i: sum p; every row alike)
        m_i = gl.full([NH], -1.0e30, gl.float32, layout=HL)
        e_cur = prefix * 0 + 124  # the exponent field whose F is 1 (a tensor: loop-carried)

        n_chunks = prefix // BS * (BS // CHUNK_C)
        per_split = gl.cdiv(n_chunks, n_split)
        lo = split * per_split
        hi = gl.minimum(n_chunks, lo + per_split)
        bt_row = block_tables_ptr + b.to(gl.int64) * stride_bt
        # loop-invariant offsets inside a page's layer region (words; so in bytes)
        NG: gl.constexpr = D // 32
        rec = KS_OFF + kvh * (HEADER + D)  # this head's K record
        ko = ((kvh * BS + tk) * (D // 8))[:, None] + wk[None, :]
        vo = V_OFF // 4 + ((kvh * BS + tv) * (D // 8))[:, None] + wv[None, :]
        co = (rec + HEADER) // 4 + (rc * 0)[:, None] + wc[None, :]
        # V codes: word (k NG + group) / 4 of the token pair holds code k (s, m of 2tp, then of 2tp + 1)
        grp = (gm * D // 256)[None, :, None]  # lane g's 32-channel group
        if NG == 4:  # the token pair's 4 words are the codes in order: one 16-byte load
            code_word = kc[None, None, :] + grp * 0
        else:
            code_word = (kc[None, None, :] * NG + grp) // 4
        so = (VS_OFF + kvh * BS * 2 * NG) // 4 + (tp * NG)[:, None, None] + code_word
        byte = ((kc * NG)[None, None, :] + grp) % 4  # [1, 8, 4]: the code's byte in its word
        byte = gl.reshape(byte + gl.zeros([8, 8, 4], gl.int32, layout=LVC), [8, 8, 2, 2])
        b_s, b_m = gl.split(byte)
        sa, sb = gl.split(b_s)
        ma, mb_ = gl.split(b_m)
        sel_s = (sa + (4 + sb) * 16).to(gl.uint32)  # prmt selectors: token 2tp's byte, then 2tp + 1's
        sel_m = (ma + (4 + mb_) * 16).to(gl.uint32)
        # the next chunk's keys load once this chunk's scores are done, its values once its values
        # are: into the registers just freed (loads issued a whole chunk ahead need a second set, and
        # ptxas copies every word once a chunk); the pages two chunks ahead are asked of L2 (L2PF)
        CPP: gl.constexpr = BS // CHUNK_C
        last = gl.maximum(hi - 1, 0)
        c0 = gl.minimum(lo, last)
        if USE_RING:  # the first RING - 1 chunks' copies in flight; a chunk issues the one RING - 1 ahead
            kring, vring, mring = ring_buffers(RING, D)
            rk, rv, rm, rmv, rm_ok = ring_offsets(kvh, rec, V_OFF, VS_OFF, BS, D)
            for i in gl.static_range(RING - 1):
                ci = gl.minimum(lo + i, last)
                ring_issue(kring, vring, mring, i, page_base(pool_ptr, gl.load(bt_row + ci // CPP), page_stride,
                                                             layer_off), ci, rk, rv, rm, rmv, rm_ok, BS, D)
            page_n = gl.load(bt_row + gl.minimum(lo + RING - 1, last) // CPP)
            cs_like = gl.zeros([8, D // 4], gl.uint32, LCB)
            vc_like = gl.zeros([8, 8, 4], gl.uint32, LVC)
        else:
            pb = page_base(pool_ptr, gl.load(bt_row + c0 // CPP), page_stride, layer_off)
            kw, cs, hk = load_keys(pb, c0, ko, co, rec, BS, D, load_hint(0, L1NA))
            vw, vc, hv = load_values(pb, c0, vo, so, rec, BS, D, load_hint(0, L1NA))
            page1 = gl.load(bt_row + gl.minimum(lo + 1, last) // CPP)
            page2 = gl.load(bt_row + gl.minimum(lo + 2, last) // CPP)
        if TAIL_FIRST:  # while the first chunk loads: the tail's round trips overlap the pages' first ones
            if split == n_split - 1:
                acc_t, m_i, l_t, _ = residual_tail(gl.zeros([D, NH], gl.float32, layout=MMA), m_i, gl.zeros_like(m_i), q_rows,
                                           g_rows, k_new, v_new, res_k, prefix % BS, tq, cq, qk_scale, KVH, BS, D, BF16,
                                           NH)
                rows = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
                acc = acc_t / odd_rows_unit(rows)[:, None]  # into the pages' units (F = 1 at e_cur 124)
                l_i = l_i + gl.convert_layout(l_t, gl.SliceLayout(0, l_i.type.layout), assert_trivial=True)[None, :]
        if L2PF and not USE_RING:
            k0 = kvh * BS * (D // 2)  # a chunk's K and V rows (8 D bytes each), the head's K record, V codes
            lines, per_row = chunk_lines(k0, V_OFF + k0, KS_OFF + kvh * (HEADER + D), VS_OFF + kvh * BS * (D // 16),
                                         8 * D, 8 * D, HEADER + D, D, D // 2, D // 2, 0, D // 16)
        # the pages' q . m, 16 pages at a time (page_offsets); a chunk loads its page's row
        LCM: gl.constexpr = words_layout(D // 4, 16)
        rr = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, LCM))
        cso = (rec + HEADER) // 4 + gl.arange(0, D // 4, layout=gl.SliceLayout(0, LCM))
        p_last = last // CPP
        offsets = gl.allocate_shared_memory(gl.float32, [CHUNK_C, NH], ROWS)  # [16 pages, NH heads]
        # the same bytes as rows: index() wants a layout a rank below the shape, the [16, NH] store a full one
        page_rows = _as_rows(offsets, [CHUNK_C, NH])
        for p0 in range(lo // CPP, gl.cdiv(hi, CPP), CHUNK_C):
            q_op = b_operand(logical_k(q_pairs(q_lo.load(LCQ), q_hi.load(LCQ)), D), D)
            offsets.store(page_offsets(pool_ptr, bt_row, p0, p_last, rr, cso, rec, q_op, sq_s.load(MMA), qk_q,
                                        page_stride, layer_off, D))
            for c in range(gl.maximum(lo, p0 * CPP), gl.minimum(hi, (p0 + CHUNK_C) * CPP)):
                if USE_RING:
                    rs = (c - lo) % RING  # the ring slot of this chunk
                    ring_wait(RING - 2)  # this chunk's group is in (and the slot refilled below was read)
                    kw, cs, hk = ring_keys(kring, mring, rs, cs_like, D)
                    ring_issue(kring, vring, mring, (c - lo + RING - 1) % RING,
                               page_base(pool_ptr, page_n, page_stride, layer_off), gl.minimum(c + RING - 1, last),
                               rk, rv, rm, rmv, rm_ok, BS, D)
                    page_n = gl.load(bt_row + gl.minimum(c + RING, last) // CPP)
                else:
                    if L2PF:
                        prefetch_l2(pool_ptr, page2, gl.minimum(c + 2, last), lines, per_row, page_stride, layer_off,
                                    BS)
                    page3 = gl.load(bt_row + gl.minimum(c + 3, last) // CPP)
                    pb = page_base(pool_ptr, page1, page_stride, layer_off)
                offset = page_rows.index(c // CPP - p0).load(HL)[None, :]  # the page's row, for all 16 tokens
                st = chunk_scores(q_lo.load(LCQ), q_hi.load(LCQ), kw, cs, hk, offset, k_unit, D)
                if USE_RING:
                    vw, vc, hv = ring_values(vring, mring, rs, vc_like, D)
                else:
                    kw, cs, hk = load_keys(pb, gl.minimum(c + 1, last), ko, co, rec, BS, D, load_hint(0, L1NA))
                acc, accm, mb, m_i, l_i, e_cur = softmax_values(acc, accm, mb, m_i, l_i, e_cur, st, vw, vc, sel_s,
                                                                 sel_m, hv, D, NH == 8)
                if not USE_RING:
                    vw, vc, hv = load_values(pb, gl.minimum(c + 1, last), vo, so, rec, BS, D, load_hint(0, L1NA))
                    page1 = page2
                    page2 = page3
        if USE_RING:
            ring_wait(0)  # no copy outlives the program
        m = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
        acc = acc * (odd_rows_unit(m) * ((e_cur + 3) << 23).to(gl.float32, bitcast=True))[:, None]  # 1 / F
        accm = gl.convert_layout(rows_joined(accm, accm), MMA, assert_trivial=True)  # lane g's group in rows g, g + 8
        l_i = gl.convert_layout(gl.max(l_i, axis=0), HL)
        mb = gl.convert_layout(gl.max(mb, axis=0), HL)

        if not TAIL_FIRST:  # the last split: residual tail (prefix % BS tokens, full precision) and the new token
            if split == n_split - 1:
                acc, m_i, l_i, alpha = residual_tail(acc, m_i, l_i, q_rows, g_rows, k_new, v_new, res_k, prefix % BS, tq, cq,
                                             qk_scale, KVH, BS, D, BF16, NH)
                accm = accm * alpha[None, :]
                mb = mb * alpha

        # 3. add the m parts, normalize, store (in memory channel order)
        acc3 = gl.reshape(acc, [D // CHUNK_C, CHUNK_C, NH])  # [m-tile, row in tile, head]
        accm3 = gl.convert_layout(accm, gl.SliceLayout(0, acc3.type.layout), assert_trivial=True)
        acc = gl.convert_layout(gl.reshape(acc3 + gl.expand_dims(accm3, 0), [D, NH]), MMA, assert_trivial=True)
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        o = (acc + mb[None, :]) * (1.0 / l_safe)[None, :]
        store_output(o, l_i, m_i, out_ptr, part_out_ptr, part_lse_ptr, count_ptr, b, kvh, split, stride_ob,
                     stride_oh, num_splits, u, n_split, KVH, G, D, PARTIAL, FUSED, RMAX, WORK)


def decode_int4_direct(cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float, *,
                       splits: int | None = None, fused: bool | None = None,
                       maxnreg: int | None = -1,
                       l2_prefetch: bool = True, tail_first: bool = True,
                       l1_no_allocate: bool = True, ring: int = RING) -> torch.Tensor:
    """out [B, H, D] for q [B, H, D] fp16 or bf16 (one new token per sequence; k/v [B, KVH, D] its new
    K/V) over int4 pages; `supports` must hold and the caller has checked the arguments. `splits`
    overrides the split count, `fused` whether the last split reduces (None: up to
    FUSED_MAX_SPLITS), `maxnreg` the register cap (-1: REGISTER_CAP_D64 at head_dim 64, at 128
    REGISTER_OPTIONS, the cheaper for the shape, none at 16 head columns or head_dim 256; None:
    none), `tail_first` whether the last split takes its tail before its pages, `l1_no_allocate`
    whether its row loads skip L1 (register loads), `ring` the cp.async ring's depth where it serves
    (head_dim 128, G <= 8; 0: register loads). G 9-16 run two MMA n-tiles (see ROUTED_GROUP)."""
    nh = head_columns(q.shape[1] // cache.layout.kv_heads)
    ring = ring if q.shape[2] == 128 and nh == 8 else 0
    if maxnreg == -1:  # head_dim 256 and 16 head columns spill under any cap that keeps more programs
        maxnreg = (RING_REGISTER_CAP if ring else
                   {64: REGISTER_CAP_D64, 128: REGISTER_OPTIONS}.get(q.shape[2]) if nh == 8 else None)
    return launch_direct(decode_int4_direct_kernel, "int4-direct", cache, layer, q, k, v, meta, scale,
                         splits=splits, fused=fused, maxnreg=maxnreg, RING=ring,
                         L2PF=l2_prefetch, TAIL_FIRST=tail_first, L1NA=l1_no_allocate, NH=nh)
