"""What an INT4 decode chunk loads of a page for one KV head, in the register-direct kernel's
layouts (`decode_int4_direct.py`; Gluon, GPU only): the key words, the K s codes and header, the
value words, the V code words and header, either straight into registers or through a cp.async ring
in shared memory (head_dim 128, G <= 8). Offsets are loop-invariant word offsets inside a page's
layer region, so each load costs one address at most."""
from __future__ import annotations

from kvmesh.kernels.mma_fragments import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from kvmesh.kernels.int4_codec import HEADER  # bytes of the K and V headers of each head's K record
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


# The cp.async ring (head_dim 128, G <= 8): each of a program's chunks copies its four page runs into a
# shared-memory slot RING - 1 chunks ahead, and reads them back into the fragments where they are used.
# Every lane copies 16-byte units: K rows and V rows 2 each, and one unit of the small runs.
if HAVE_GLUON:
    # 16-byte units of a slot's small runs (17 used: 0-7 the K s codes, 8-15 the V codes, 16 the K and V
    # headers; a power of two, and each run's slice starts at a multiple of its length, as Gluon wants)
    RING_UNITS = gl.constexpr(32)

    @gluon.constexpr_function
    def v_ring_layout():
        """A slot's V rows [16 tokens, 16 words] in shared memory, XOR-swizzled (offset bits -> [token,
        word]): a half-warp's 8-byte reads in `v_words_layout` (tokens 2t, 2t + 2, .., words 2w) hit 32
        distinct banks, where rows in order put tokens 0, 2, 4, 6 in the same 16 (4-way conflicts). The
        16-byte units the copies write stay whole."""
        return gl.SharedLinearLayout([[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 8], [5, 0], [8, 0]])

    @gluon.jit
    def ring_buffers(RING: gl.constexpr, D: gl.constexpr):
        """The ring's RING slots: K rows, V rows [RING, 16, D/8] and the small runs' words [RING, 128]."""
        PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        return (gl.allocate_shared_memory(gl.uint32, [RING, CHUNK_C, D // 8], PLAIN),
                gl.allocate_shared_memory(gl.uint32, [RING, CHUNK_C, D // 8], v_ring_layout()),
                gl.allocate_shared_memory(gl.uint32, [RING, RING_UNITS * 4], gl.SwizzledSharedLayout(1, 1, 1, [0])))

    @gluon.jit
    def ring_offsets(kvh, rec, V_OFF: gl.constexpr, VS_OFF: gl.constexpr, BS: gl.constexpr, D: gl.constexpr):
        """Word offsets inside a page's layer region of what a chunk copies (the page's first chunk; a
        chunk further in adds its rows, `ring_issue`): K rows, V rows [16, D/8]; the small runs' 128
        words, a 16-byte unit a lane (units 0-7 the head's K s codes from its K record `rec`, 8-15 the
        V codes, 16 the K and V headers), which of them move with the chunk's rows, which are copied."""
        CPK: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0])
        rk = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(1, CPK))
        wk = gl.arange(0, D // 8, layout=gl.SliceLayout(0, CPK))
        ko = ((kvh * BS + rk) * (D // 8))[:, None] + wk[None, :]
        i = gl.arange(0, RING_UNITS * 4, layout=gl.BlockedLayout([4], [32], [1], [0]))
        u, w = i // 4, i % 4
        vcodes = (VS_OFF + kvh * BS * (D // 16)) // 4  # D / 16 bytes of (s, m) codes a token
        mo = gl.where(u < 8, (rec + HEADER) // 4 + i, gl.where(u < 16, vcodes + (i - 32), rec // 4 + w))
        return ko, V_OFF // 4 + ko, mo, ((u >= 8) & (u < 16)).to(gl.int32), u < 17

    @gluon.jit
    def _copy_36(smem, p, mask):
        async_copy.async_copy_global_to_shared(smem, p, mask=mask)

    @gluon.jit
    def _copy_39(smem, p, mask):
        async_copy.async_load(smem, p, mask=mask)

    # a cp.async of a tensor of pointers into shared memory (Triton 3.9 renamed it async_load)
    _copy = _copy_39 if hasattr(async_copy, "async_load") else _copy_36

    @gluon.jit
    def _barrier_36():
        gl.thread_barrier()

    @gluon.jit
    def _barrier_39():
        gl.barrier()

    _barrier = _barrier_39 if hasattr(gl, "barrier") else _barrier_36  # renamed in Triton 3.9

    @gluon.jit
    def ring_wait(PENDING: gl.constexpr):
        """Waits until at most PENDING of this thread's newest copy groups are in flight, then for every
        lane to get there: the slot is whole, and the slot refilled next has been read by all."""
        async_copy.wait_group(PENDING)
        _barrier()

    @gluon.jit
    def ring_issue(kring, vring, mring, slot, pb, chunk, ko, vo, mo, moves, m_ok, BS: gl.constexpr,
                   D: gl.constexpr):
        """Copies chunk `chunk` of the page at `pb` into `slot`, as one cp.async group."""
        p32 = pb.to(gl.pointer_type(gl.uint32), bitcast=True)
        r = (chunk % (BS // CHUNK_C)) * CHUNK_C  # the chunk's first row inside the page
        _copy(kring.index(slot), p32 + (ko + r * (D // 8)), None)
        _copy(vring.index(slot), p32 + (vo + r * (D // 8)), None)
        _copy(mring.index(slot), p32 + (mo + moves * (r * (D // 64))), m_ok)
        async_copy.commit_group()

    @gluon.jit
    def _word(x, i: gl.constexpr):
        """Element i of a [4] tensor every thread holds whole, as a scalar (no shuffles)."""
        return gl.sum(gl.where(gl.arange(0, 4, layout=x.type.layout) == i, x, 0), axis=0)

    @gluon.jit
    def _header(x, i: gl.constexpr):
        return _word(x, i).to(gl.uint64) | (_word(x, i + 1).to(gl.uint64) << 32)

    @gluon.jit
    def ring_keys(kring, mring, slot, cs_like, D: gl.constexpr):
        """A slot's key words as `load_keys` gives them: K [16, D/8], the K s codes [8, D/4] (broadcast
        over cs_like's rows: each lane reads its words once), the K header."""
        small = mring.index(slot)
        kw = kring.index(slot).load(words_layout(D // 8, 16))
        cs = gl.broadcast(small.slice(0, D // 4).load(gl.SliceLayout(0, cs_like.type.layout))[None, :], cs_like)[0]
        return kw, cs, _header(small.slice(64, 4).load(gl.BlockedLayout([4], [32], [1], [0])), 0)

    @gluon.jit
    def ring_values(vring, mring, slot, vc_like, D: gl.constexpr):
        """A slot's value words as `load_values` gives them: V [16, D/8], the V code words [8 tp, 8 g, 4]
        (broadcast over vc_like's groups: at D 128 every lane's token pair is the same 16 bytes), the V
        header."""
        small = mring.index(slot)
        vw = vring.index(slot).load(v_words_layout(D))
        codes = small.reshape([RING_UNITS, 4]).slice(8, 8)  # units 8-15: [8 token pairs, 4 words]
        vc = gl.broadcast(codes.load(gl.SliceLayout(1, vc_like.type.layout))[:, None, :], vc_like)[0]
        return vw, vc, _header(small.slice(64, 4).load(gl.BlockedLayout([4], [32], [1], [0])), 2)
