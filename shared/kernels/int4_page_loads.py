"""What an INT4 decode chunk loads of a page for one KV head, in the register-direct kernel's
layouts (`decode_int4_direct.py`; Gluon, GPU only): the key words, the K s codes and header, the
value words, the V code words and header. Offsets are loop-invariant word offsets inside a page's
layer region, so each load costs one address at most."""
from __future__ import annotations

from kvmesh.kernels.mma_fragments import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from kvmesh.kernels.int4_fragments import v_words_layout, words_layout
    from kvmesh.kernels.mma_fragments import CHUNK_C, load_pack

    @gluon.jit
    def header_scalars(h):
        """A header (uint64: bf16 m_base, m_step, s_step, 0) -> three fp32 scalars."""
        m_base = (h.to(gl.uint32) << 16).to(gl.float32, bitcast=True)
        m_step = ((h >> 16).to(gl.uint32) << 16).to(gl.float32, bitcast=True)
        s_step = ((h >> 32).to(gl.uint32) << 16).to(gl.float32, bitcast=True)
        return m_base, m_step, s_step

    @gluon.jit
    def load_keys(pb, chunk, ko, co, rec, BS: gl.constexpr, D: gl.constexpr, HINT: gl.constexpr = ""):
        """A chunk's key words: K [16, D/8], the K s codes [8, D/4] (B-side layout), the page's K header
        (uint64); ko / co: the loop-invariant word offsets of the thread's elements inside a page's
        layer region, rec: the head's K record there (bytes); HINT: the row loads' qualifiers."""
        p32 = pb.to(gl.pointer_type(gl.uint32), bitcast=True)
        LKW: gl.constexpr = words_layout(D // 8, 16)
        if BS // CHUNK_C > 1:  # the chunk's rows inside the page
            kw = load_pack(p32 + (ko + (chunk % (BS // CHUNK_C)) * CHUNK_C * (D // 8)), LKW, D // 2, HINT)
        else:
            kw = load_pack(p32 + ko, LKW, D // 2, HINT)
        p64 = pb.to(gl.pointer_type(gl.uint64), bitcast=True)
        return kw, gl.load(p32 + co), gl.load(p64 + rec // 8)

    @gluon.jit
    def load_values(pb, chunk, vo, so, rec, BS: gl.constexpr, D: gl.constexpr, HINT: gl.constexpr = ""):
        """A chunk's value words: V [16, D/8], the V code words [8 tp, 8 g, 4] (v_codes_layout), the
        page's V header (uint64); vo / so / HINT as in `load_keys`."""
        p32 = pb.to(gl.pointer_type(gl.uint32), bitcast=True)
        if BS // CHUNK_C > 1:
            r = (chunk % (BS // CHUNK_C)) * CHUNK_C
            vw = load_pack(p32 + (vo + r * (D // 8)), v_words_layout(D), D // 2, HINT)
            vc = gl.load(p32 + (so + r * (D // 64)))
        else:
            vw = load_pack(p32 + vo, v_words_layout(D), D // 2, HINT)
            vc = gl.load(p32 + so)
        p64 = pb.to(gl.pointer_type(gl.uint64), bitcast=True)
        return vw, vc, gl.load(p64 + rec // 8 + 1)
