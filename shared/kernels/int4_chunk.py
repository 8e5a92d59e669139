"""The steps of the register-direct INT4 decode kernel (`decode_int4_direct.py`) over its chunks, in
Gluon (GPU only): the score offsets of 16 pages at a time, a chunk's scores, its online softmax and
values, the state's rescale and the residual tail. The math and the units
are the kernel's module docstring's; fragments and PTX: `int4_fragments.py`."""
from __future__ import annotations

from kvmesh.kernels.mma_fragments import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from kvmesh.kernels.int4_fragments import (b_operand, code_pairs, k_nibbles, logical_k, logical_k_fp16,
                                               m_codes_operand, row_halves, rows_joined, scaled_code_pairs,
                                               v_code_pairs, v_nibbles)
    from kvmesh.kernels.int4_page_loads import header_scalars
    from kvmesh.kernels.mma_fragments import (A_OP, B_OP, CHUNK_C, MMA, q_operand, tail_rows, to_fp16, v_layout,
                                              v_operand)
    from kvmesh.kernels.split_partials import page_base

    @gluon.jit
    def rescale(acc, accm, mb, l_i, alpha, e_cur, e_new):
        """The state in units of a new max (alpha = 2**(old max - new)) and a new F (from exponent
        field e_cur to e_new: a power of two, no division)."""
        acc = acc * (alpha * ((e_cur - e_new + 127) << 23).to(gl.float32, bitcast=True))[None, :]
        alpha8 = gl.convert_layout(alpha, gl.SliceLayout(0, l_i.type.layout), assert_trivial=True)[None, :]
        return acc, accm * alpha8, mb * alpha8, l_i * alpha8

    @gluon.jit
    def chunk_values(acc, accm, mb, l_i, st, m_i, e_cur, vw, vc, sel_s, sel_m, v_ss, v_ms, v_mb, D: gl.constexpr):
        """p = 2**(st - m_i) and the chunk's values into the state: V^T P^T into acc (units of F, from
        exponent field e_cur), the m codes' MMA into accm and, through its ones, sum p into l_i and
        m_base sum p into mb."""
        pt = gl.convert_layout(gl.exp2(st - m_i[None, :]).to(gl.float16), B_OP)
        vsf = v_ss * ((251 - e_cur) << 23).to(gl.float32, bitcast=True) + gl.zeros_like(sel_s).to(gl.float32)
        s2, m2 = v_code_pairs(vc, sel_s, sel_m, vsf)  # [8 tp, 8 g]: true scale x F; the m codes
        acc = mma_v2(v_nibbles(vw, s2, D), pt, acc)
        mm, sp = row_halves(mma_v2(m_codes_operand(m2), pt, gl.zeros([CHUNK_C, pt.shape[1]], gl.float32, layout=MMA)))
        return acc, accm + mm * v_ms, mb + sp * v_mb, l_i + sp

    @gluon.jit
    def page_offsets(pool_ptr, bt_row, p0, p_last, rr, cso, rec, q_op, sq, qk_q, page_stride, layer_off,
                      D: gl.constexpr):
        """q . m of 16 pages at once, m = -7.5 s per channel (symmetric keys: a page's score offset, the
        same for its every token), in log2 units: [16 pages, NH heads] (MMA layout), page p0 + r in row r
        (pages past p_last read p_last). One MMA over the 16 pages' s codes against q, where a chunk
        at a time took an MMA whose 16 rows were all alike."""
        pages = gl.load(bt_row + gl.minimum(p0 + rr, p_last))  # [16]
        pb = page_base(pool_ptr, pages, page_stride, layer_off)
        cs = gl.load(pb.to(gl.pointer_type(gl.uint32), bitcast=True)[:, None] + cso[None, :])  # [16, D/4]
        hk = gl.load(pb.to(gl.pointer_type(gl.uint64), bitcast=True) + rec // 8)
        _, _, k_ss = header_scalars(gl.convert_layout(hk, gl.SliceLayout(1, MMA), assert_trivial=True))
        cs_op = gl.convert_layout(logical_k(code_pairs(cs), D), A_OP, assert_trivial=True)
        qc = mma_v2(cs_op, q_op, gl.zeros([CHUNK_C, q_op.shape[1]], gl.float32, layout=MMA))  # sum q' (4 + cs / 256)
        return (qc - 4.0 * sq) * (qk_q * -1920.0 * k_ss)[:, None]  # -7.5 * 256 s_step sum q' cs / 256

    @gluon.jit
    def chunk_scores(ql, qh, kw, cs, hk, offset, k_unit, D: gl.constexpr):
        """S^T [16 tokens, NH heads] of a chunk of full pages, in log2 units; offset [1, NH]: the page's
        q . m (`_page_offsets`), every row alike; k_unit: the nibble and code units and the softmax
        scale, over q's power of two."""
        _, _, k_ss = header_scalars(hk)  # -7.5 s, the page's offset, comes from page_offsets
        if ql.shape[0] != cs.shape[0]:  # 16 head rows: the page's codes serve both n-tiles
            cs = gl.convert_layout(rows_joined(cs, cs), ql.type.layout, assert_trivial=True)
        # keys: q' * cs 2**-24 (a byte permute and a multiply a pair), nibbles n 2**-24: subnormals
        qs_op = b_operand(logical_k(scaled_code_pairs(cs, ql, qh), D), D)
        st = mma_v2(k_nibbles(kw, D), qs_op, gl.zeros([CHUNK_C, qs_op.shape[1]], gl.float32, layout=MMA))
        return st * (k_unit * k_ss) + offset

    @gluon.jit
    def softmax_values(acc, accm, mb, m_i, l_i, e_cur, st, vw, vc, sel_s, sel_m, hv, D: gl.constexpr,
                       LAZY: gl.constexpr, GROW: gl.constexpr = 8):
        """The online softmax of a chunk's scores st and its values into the state: acc in units of
        F (e_cur: the V s_step exponent field F was taken from, plus one), the V m part into accm / mb
        ([8 g, NH heads]; mb and l_i: every row alike). Returns the updated state.
        The state is rescaled only where it must be (a branch the warp takes together, ~50 of ~390
        instructions a chunk): where a head's max grew by more than GROW (log2 units; below that p =
        2**(st - m_i) stays under 2**GROW, fine in fp16 and fp32), or where the page's V s_step
        exponent leaves (e_cur - 8, e_cur]: F = 2**(124 - e_cur) must keep the scale pairs below 64
        (1024 s fits fp16) and normal. F's are powers of two, so their ratio is a difference of
        exponent fields (no division); F takes one exponent of headroom, so a page with twice the scale
        moves nothing. H200: +1 to +3 % at three of the four cases, = at 256 x 1,024 (docs/decode_direct.md).
        LAZY False: every chunk rescales (G 9-16, where the lazy branch has not yet run on a GPU)."""
        v_mb, v_ms, v_ss = header_scalars(hv)
        e_page = (v_ss.to(gl.int32, bitcast=True) >> 23) & 0xFF
        m_chunk = gl.max(st, axis=0)
        if LAZY:
            grew = gl.max((m_chunk > m_i + GROW).to(gl.int32), axis=0)  # the same in every lane
            must = (grew > 0) | (e_page > e_cur) | (e_page < e_cur - 8)
        else:
            must = e_page == e_page
        if must:
            m_new = gl.maximum(m_i, m_chunk)
            e_new = e_page + (1 if LAZY else 0)  # headroom where F may stay
            acc, accm, mb, l_i = rescale(acc, accm, mb, l_i, gl.exp2(m_i - m_new), e_cur, e_new)
            m_i = m_new
            e_cur = e_new
        acc, accm, mb, l_i = chunk_values(acc, accm, mb, l_i, st, m_i, e_cur, vw, vc, sel_s, sel_m, v_ss, v_ms, v_mb,
                                          D)
        return acc, accm, mb, m_i, l_i, e_cur

    @gluon.jit
    def residual_tail(acc, m_i, l_i, q_rows, g_rows, k_new, v_new, res_k, n_tail, tq, cq, qk_scale,
                      KVH: gl.constexpr, BS: gl.constexpr, D: gl.constexpr, BF16: gl.constexpr, NH: gl.constexpr):
        """The residual tail (n_tail tokens at res_k, full precision) and the new token (k_new / v_new
        [D]) into acc [D, NH] (plain units), m_i and l_i ([NH], HL), in masked 16-token chunks; also
        returns the product of the rescales, for the m parts' sums."""
        LV: gl.constexpr = v_layout(D, False)
        tv = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, LV))
        cv = gl.arange(0, D, layout=gl.SliceLayout(0, LV))
        qt = gl.load(q_rows, mask=(tq < g_rows)[:, None], other=0.0)
        if BF16:  # the same power of two as the pages' q (qk_scale has it)
            qt, fq = to_fp16(qt, tq < g_rows)
        q_op = q_operand(logical_k_fp16(qt.to(gl.float16), D), NH)
        alpha_all = gl.full(m_i.shape, 1.0, gl.float32, layout=m_i.type.layout)
        for t0 in range(0, n_tail + 1, CHUNK_C):
            kf, vf, fk, fv = tail_rows(k_new, v_new, res_k, t0, n_tail, tq, cq, tv, cv, KVH, BS, D, BF16)
            k_op = gl.convert_layout(logical_k_fp16(kf, D), A_OP, assert_trivial=True)
            st = mma_v2(k_op, q_op, gl.zeros([CHUNK_C, NH], gl.float32, layout=MMA)) * (qk_scale * fk)
            valid = (t0 + gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, MMA))) <= n_tail
            st = gl.where(valid[:, None], st, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(st, axis=0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(st - m_new[None, :])
            l_i = l_i * alpha + gl.sum(p, axis=0)
            pt = gl.convert_layout((p * fv).to(gl.float16), B_OP)
            acc = mma_v2(v_operand(vf, D), pt, acc * alpha[None, :])
            alpha_all = alpha_all * alpha
            m_i = m_new
        return acc, m_i, l_i, alpha_all
