"""Where a 16-token chunk of an INT4 page lands in mma.m16n8k16 fragments, for
`decode_int4_direct.py`: the layouts each thread loads its words in, the nibble and code decodes
(inline PTX, several registers per instruction) and the relabelings that turn them into MMA
operands without moving data (checked at compile time, `assert_trivial=True`). Gluon; GPU only.

Memory (kv/layout.py): a token's D channels are D/8 little-endian words, channel 8w + i in nibble i
of word w; the page's K s codes per channel, each eight stored as channels 0, 1, 4, 5, 2, 3, 6, 7
(so a word's bytes pair up as (c, c + 4)); V codes (s, m) per token and 32-channel group.

- K is the A operand [16 tokens, D] of S^T = K . q^T. A thread (g = lane/4, t = lane%4) loads the
  D/32 words (D/4 channels) from word (D/32) t of tokens g and g + 8 (one 16-byte load each at D =
  128). A word's halves hold channels 0-3 and 4-7, so masking nibble i of both halves gives the
  fp16 pair (channel i, i + 4) in one instruction: as a subnormal, n * 2**-24 (i even) or
  16 n * 2**-24 (i odd, the nibble sits 4 bits up); q carries 1/16 on odd channels. Logical
  channel (the MMA's k) and memory channel of a thread's pair p (of word wi, nibble r = 2a + b):
      k = 16 (2 wi + a) + 8 b + 2 t + pl      c = (D/4) t + 8 wi + 4 pl + 2 a + b
  q^T (the B operand) and the K codes take the same order.
- V^T is the A operand [D, 16 tokens] of O^T = V^T . P^T: a thread loads the D/64 words (D/8
  channels) from word (D/64) g of tokens 2t, 2t+1, 2t+8, 2t+9. One byte permute puts channels 0-3
  of two tokens side by side, so a masked nibble is the token pair (2t, 2t+1) of one channel, as
  MMA wants; logical row m = g + 8 u for memory channel (D/8) g + u (as mma_fragments.v_operand).
  A thread's channels lie in one 32-channel group, so its per-token scales are 2 registers.
"""
from kvmesh.kernels.mma_fragments import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from kvmesh.kernels.mma_fragments import A_OP, B_OP, CHUNK_C

    @gluon.constexpr_function
    def words_layout(W, ROWS):
        """[ROWS (16 tokens or rows, or 8 heads), W elements]: a thread holds W/4 contiguous elements
        from (W/4) t of rows g (and g + 8 when ROWS = 16). K nibbles: W = D/8 words, one token a row;
        8-bit codes broadcast over the rows: W = D/4 words; fp16 q or K rows: W = D channels."""
        per = W // 4
        regs = [[0, 1 << i] for i in range(per.bit_length() - 1)] + ([[8, 0]] if ROWS == 16 else [])
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, per], [0, 2 * per], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=[], block_bases=[], shape=[ROWS, W])

    @gluon.constexpr_function
    def v_words_layout(D):
        """[16 tokens, D/8 words]: a thread holds the D/64 words from (D/64) g of tokens 2t, 2t+1,
        2t+8, 2t+9 (token bit 0 in a register: the pair splits off without moving)."""
        per = D // 64
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1 << i] for i in range(per.bit_length() - 1)] + [[1, 0], [8, 0]],
            lane_bases=[[2, 0], [4, 0], [0, per], [0, 2 * per], [0, 4 * per]],
            warp_bases=[], block_bases=[], shape=[CHUNK_C, D // 8])

    @gluon.jit
    def _u32_pairs(w):
        """uint32 [..., N] of fp16 pairs -> fp16 [..., N, 2] (low half first); registers renamed only."""
        return gl.join((w & 0xFFFF).to(gl.uint16), (w >> 16).to(gl.uint16)).to(gl.float16, bitcast=True)

    @gluon.jit
    def _join4(r0, r1, r2, r3):
        """Four pair tensors [R, W] (pair p = 2a + b of each eight) -> fp16 [R, W, 2 pl, 2 b, 2 a]."""
        return gl.join(gl.join(_u32_pairs(r0), _u32_pairs(r1)), gl.join(_u32_pairs(r2), _u32_pairs(r3)))

    @gluon.jit
    def logical_k(x, D: gl.constexpr):
        """[R, W, 2 pl, 2 b, 2 a] pairs of the thread words (word = (D/32) t + wi) -> [R, D] in logical
        channel order k = 16 (2 wi + a) + 8 b + 2 t + pl (see the module docstring)."""
        R: gl.constexpr = x.shape[0]
        x = gl.reshape(x, [R, 4, D // 32, 2, 2, 2])  # [R, t, wi, pl, b, a]
        return gl.reshape(gl.permute(x, [0, 2, 5, 4, 1, 3]), [R, D])

    @gluon.jit
    def logical_k_fp16(x, D: gl.constexpr):
        """fp16 [R, D] in memory channel order (words_layout(D, R)) -> logical channel order."""
        R: gl.constexpr = x.shape[0]
        x = gl.reshape(x, [R, 4, D // 32, 2, 2, 2])  # memory c = (D/4) t + 8 wi + 4 pl + 2 a + b
        return gl.reshape(gl.permute(x, [0, 2, 4, 5, 1, 3]), [R, D])

    @gluon.jit
    def k_nibbles(w, D: gl.constexpr):
        """uint32 [16, D/8] K words (words_layout(D // 8, 16)) -> the A operand [16, D] of S^T: subnormal
        fp16 n * 2**-24 (even channels) and 16 n * 2**-24 (odd), one LOP3 a pair, exact."""
        asm: gl.constexpr = """{ .reg .b32 u; shr.b32 u, $4, 8;
            and.b32 $0, $4, 0x000F000F; and.b32 $1, $4, 0x00F000F0;
            and.b32 $2, u, 0x000F000F; and.b32 $3, u, 0x00F000F0; }"""
        r0, r1, r2, r3 = gl.inline_asm_elementwise(asm=asm, constraints="=r,=r,=r,=r,r", args=[w],
                                                   dtype=(gl.uint32,) * 4, is_pure=True, pack=1)
        return gl.convert_layout(logical_k(_join4(r0, r1, r2, r3), D), A_OP, assert_trivial=True)

    @gluon.jit
    def _code_words(words):
        """[R, D/4] words (four codes or pair words each) -> the words of each eight's halves [R, D/8] x 2."""
        return gl.split(gl.reshape(words, [words.shape[0], words.shape[1] // 2, 2]))

    @gluon.jit
    def code_pairs(words):
        """uint32 [R, D/4] words of four 8-bit codes in record order (word 2e: channels 8e + 0, 1, 4, 5;
        word 2e + 1: 8e + 2, 3, 6, 7; kv/layout.py) -> fp16 [R, D/8, 2, 2, 2] (_join4 order): pairs
        (c_p, c_{p+4}) of each eight, one byte permute each, as 4 + c / 256 exactly (fp16(0x4400 | c)),
        odd p as 64 + c / 16 = 16 x (4 + c / 256) (fp16(0x5400 | c): odd channels decode 16x; the
        permute's constant holds both high bytes)."""
        x, y = _code_words(words)  # codes (0, 1, 4, 5) and (2, 3, 6, 7) of each eight (record order)
        c0, c1, c2, c3 = gl.inline_asm_elementwise(
            asm="""{ .reg .b32 k; mov.b32 k, 0x54445444;
            prmt.b32 $0, $4, k, 0x4240; prmt.b32 $2, $5, k, 0x4240;
            prmt.b32 $1, $4, k, 0x5351; prmt.b32 $3, $5, k, 0x5351; }""",
            constraints="=r,=r,=r,=r,r,r", args=[x, y], dtype=(gl.uint32,) * 4, is_pure=True, pack=1)
        return _join4(c0, c1, c2, c3)

    @gluon.jit
    def pair_words(x):
        """fp32 [R, D] (memory channel order, in a [R, D/4]-words-shaped layout's order: see
        `scaled_code_pairs`) -> uint32 [R, D/4] x 2 (ql, qh): word j of eight e = j // 2 holds the fp16
        pair (x[8e + j%2], x[8e + j%2 + 4]) in ql and (x[8e + 2 + j%2], x[8e + 6 + j%2]) in qh."""
        R: gl.constexpr = x.shape[0]
        x = gl.reshape(x, [R, x.shape[1] // 8, 2, 2, 2])  # [R, e, pl, a, s]: channel 8e + 4pl + 2a + s
        lo, hi = gl.split(gl.permute(x, [0, 1, 3, 4, 2]))  # pl = 0, 1: [R, e, a, s]
        w = gl.reshape(pack_f16x2(lo, hi), [R, x.shape[1], 2, 2])
        ql, qh = gl.split(gl.permute(w, [0, 1, 3, 2]))  # a = 0, 1: [R, e, s]
        return gl.reshape(ql, [R, 2 * x.shape[1]]), gl.reshape(qh, [R, 2 * x.shape[1]])

    @gluon.jit
    def q_pairs(ql, qh):
        """The q' pair words of `pair_words` -> [8, D/8, 2, 2, 2] fp16 (_join4 order; registers renamed)."""
        q0, q1 = _code_words(ql)
        q2, q3 = _code_words(qh)
        return _join4(q0, q1, q2, q3)

    @gluon.jit
    def scaled_code_pairs(words, ql, qh):
        """K s codes (uint32 [8, D/4] words, in record order as in `code_pairs`) times the q' pairs
        from `pair_words` (ql, qh): (q' * c 2**-24) pairs, the code as an fp16 subnormal (one byte
        permute a pair, exact), the product rounded once (a normal number when max |q'| >= 2**12), as
        fp16 [8, D/8, 2, 2, 2] (_join4 order)."""
        x, y = _code_words(words)  # record order: codes (0, 1, 4, 5) and (2, 3, 6, 7) of each eight
        q0, q1 = _code_words(ql)
        q2, q3 = _code_words(qh)
        c0, c1, c2, c3 = gl.inline_asm_elementwise(
            asm="""{ .reg .b32 e;
            prmt.b32 e, $4, 0, 0x4240; mul.rn.f16x2 $0, e, $6;
            prmt.b32 e, $4, 0, 0x4341; mul.rn.f16x2 $1, e, $7;
            prmt.b32 e, $5, 0, 0x4240; mul.rn.f16x2 $2, e, $8;
            prmt.b32 e, $5, 0, 0x4341; mul.rn.f16x2 $3, e, $9; }""",
            constraints="=r,=r,=r,=r,r,r,r,r,r,r", args=[x, y, q0, q1, q2, q3],
            dtype=(gl.uint32,) * 4, is_pure=True, pack=1)
        return _join4(c0, c1, c2, c3)

    @gluon.jit
    def b_operand(x, D: gl.constexpr):
        """[8, D] (heads, logical channels) -> the B operand [D, 8] (nothing moves)."""
        return gl.convert_layout(gl.permute(x, [1, 0]), B_OP, assert_trivial=True)

    @gluon.jit
    def _over_words(x, like, D: gl.constexpr):
        """[8 tp, 8 g] -> [8 tp, D/8 words] in `like`'s layout, each lane's value over its D/64 words."""
        L3: gl.constexpr = gl.reshape(like, [8, 8, D // 64]).type.layout
        x = gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(2, L3), assert_trivial=True), 2)
        x = gl.reshape(x + gl.zeros([8, 8, D // 64], gl.uint32, layout=L3), [8, D // 8])
        return gl.convert_layout(x, like.type.layout, assert_trivial=True)

    @gluon.jit
    def v_nibbles(w, s, D: gl.constexpr):
        """uint32 [16, D/8] V words (v_words_layout) and the scale pairs [8 tp, 8 g] of the token pairs
        (s = (s_2tp, s_2tp+1) of lane g's group as an fp16 pair in a uint32) -> V^T [D, 16] as the A
        operand: (1024 + n) s - 1024 s = n s in one fma a pair (rounded once); odd channels, whose
        nibble sits 4 bits up, come out as 16 n s (the caller takes the 16 off their output rows:
        `odd_rows_unit`)."""
        W: gl.constexpr = D // 8
        wa, wb = gl.split(gl.permute(gl.reshape(w, [8, 2, W]), [0, 2, 1]))  # tokens 2tp, 2tp + 1
        ns = gl.inline_asm_elementwise(  # -1024 s: exact (s < 64)
            asm="{ .reg .b32 b; mov.b32 b, 0xE400E400; mul.rn.f16x2 $0, $1, b; }",
            constraints="=r,r", args=[s], dtype=gl.uint32, is_pure=True, pack=1)
        s = _over_words(s, wa, D)
        ns = _over_words(ns, wa, D)
        asm: gl.constexpr = """{ .reg .b32 x, y, u, v, e; .reg .b32 m; mov.b32 m, 0x64006400;
            prmt.b32 x, $8, $9, 0x5410; prmt.b32 y, $8, $9, 0x7632; shr.b32 u, x, 8; shr.b32 v, y, 8;
            lop3.b32 e, x, 0x000F000F, m, 0xEA; fma.rn.f16x2 $0, e, $10, $11;
            lop3.b32 e, x, 0x00F000F0, m, 0xEA; fma.rn.f16x2 $1, e, $10, $11;
            lop3.b32 e, u, 0x000F000F, m, 0xEA; fma.rn.f16x2 $2, e, $10, $11;
            lop3.b32 e, u, 0x00F000F0, m, 0xEA; fma.rn.f16x2 $3, e, $10, $11;
            lop3.b32 e, y, 0x000F000F, m, 0xEA; fma.rn.f16x2 $4, e, $10, $11;
            lop3.b32 e, y, 0x00F000F0, m, 0xEA; fma.rn.f16x2 $5, e, $10, $11;
            lop3.b32 e, v, 0x000F000F, m, 0xEA; fma.rn.f16x2 $6, e, $10, $11;
            lop3.b32 e, v, 0x00F000F0, m, 0xEA; fma.rn.f16x2 $7, e, $10, $11; }"""
        y = gl.inline_asm_elementwise(asm=asm, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                                      args=[wa, wb, s, ns], dtype=(gl.uint32,) * 8, is_pure=True, pack=1)
        x = gl.join(gl.join(gl.join(_u32_pairs(y[0]), _u32_pairs(y[1])), gl.join(_u32_pairs(y[2]), _u32_pairs(y[3]))),
                    gl.join(gl.join(_u32_pairs(y[4]), _u32_pairs(y[5])), gl.join(_u32_pairs(y[6]), _u32_pairs(y[7]))))
        # [tp, W, b0, o0, o1, o2] with W = (D/64) g + wv; logical row m = g + 8 (8 wv + o), token 2 tp + b0
        x = gl.reshape(x, [8, 8, D // 64, 2, 2, 2, 2])  # [tp, g, wv, b0, o0, o1, o2]
        x = gl.reshape(gl.permute(x, [2, 6, 5, 4, 1, 0, 3]), [D, CHUNK_C])
        return gl.convert_layout(x, A_OP, assert_trivial=True)

    @gluon.jit
    def odd_rows_unit(m):
        """[D] logical rows of O^T -> 1/16 where the row's memory channel, (D/8) (m % 8) + m // 8, is
        odd (its V nibbles decode 16x, `v_nibbles`), else 1."""
        return gl.where((m // 8) % 2 == 1, 0.0625, 1.0)

    @gluon.constexpr_function
    def v_codes_layout():
        """[8 tp, 8 g, 4 k]: a thread holds, of token pair tp (tokens 2tp, 2tp + 1; tp = t and t + 4),
        the 4 words with its group's codes k = (s, m) of token 2tp, then of 2tp + 1 (lane g's group;
        one 16-byte load at D = 128, where a token pair's codes are those 4 words)."""
        return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [4, 0, 0]],
                                          lane_bases=[[1, 0, 0], [2, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                          warp_bases=[], block_bases=[], shape=[8, 8, 4])

    @gluon.jit
    def v_code_pairs(words, sel_s, sel_m, vsf):
        """The V code words (uint32 [8 tp, 8 g, 4], v_codes_layout), the byte selectors of the s and m
        codes (uint32 [8 tp, 8 g]: token 2tp's byte, and 4 + token 2tp + 1's) and the V unit s_step x F
        (fp32 [8 tp, 8 g], all alike) -> (s pairs x F, m pairs) as fp16 pairs in uint32 [8 tp, 8 g]:
        one byte permute brings a token pair's codes together, one more makes them fp16 1024 + c, an
        fma (1024 + c) u - 1024 u = c u rounds once (as fp32 c u then rounded to fp16: c u is exact in
        fp32, u in fp16)."""
        x = gl.reshape(words, [8, 8, 2, 2])  # [tp, g, token, k]
        s_pair, m_pair = gl.split(x)  # [tp, g, token] each
        sa, sb = gl.split(s_pair)
        ma, mb = gl.split(m_pair)
        u = pack_f16x2(vsf, vsf)
        return gl.inline_asm_elementwise(
            asm="""{ .reg .b32 x, y, n, k; mov.b32 k, 0xE400E400; mul.rn.f16x2 n, $8, k; mov.b32 k, 0x64006400;
            prmt.b32 x, $2, $3, $6; prmt.b32 x, x, 0x64646464, 0x5140; fma.rn.f16x2 $0, x, $8, n;
            prmt.b32 y, $4, $5, $7; prmt.b32 y, y, 0x64646464, 0x5140; sub.rn.f16x2 $1, y, k; }""",
            constraints="=r,=r,r,r,r,r,r,r,r", args=[sa, sb, ma, mb, sel_s, sel_m, u],
            dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)

    @gluon.jit
    def row_halves(x):
        """[16, N] (MMA layout) -> rows 0-7 and rows 8-15 as [8, N] each (registers renamed only)."""
        return gl.split(gl.permute(gl.reshape(x, [2, 8, x.shape[1]]), [1, 2, 0]))

    @gluon.jit
    def rows_joined(lo, hi):
        """The inverse of `row_halves`: [8, 8] x 2 -> [16, 8] (rows of lo first)."""
        return gl.reshape(gl.permute(gl.join(lo, hi), [2, 0, 1]), [2 * lo.shape[0], lo.shape[1]])

    @gluon.jit
    def token_pairs(x):
        """[16 tokens, N] (v_words_layout's token order) -> tokens (2 tp, 2 tp + 1) as [8, N] each."""
        return gl.split(gl.permute(gl.reshape(x, [8, 2, x.shape[1]]), [0, 2, 1]))

    @gluon.jit
    def pack_f16x2(lo, hi):
        """fp32 tensors -> uint32 fp16 pairs (lo in the low half), one cvt each."""
        return gl.inline_asm_elementwise(asm="cvt.rn.f16x2.f32 $0, $2, $1;", constraints="=r,r,r",
                                         args=[lo, hi], dtype=gl.uint32, is_pure=True, pack=1)

    @gluon.jit
    def m_codes_operand(pairs):
        """V m code pairs of the thread's group (uint32 [8 tp, 8 g]: fp16 (c_2tp, c_2tp+1), exact
        integers, from `v_code_pairs`) -> the A operand [16 rows, 16 tokens] whose product with P^T
        gives sum_t p_t cm_t of lane g's group in row g and sum_t p_t in rows 8-15 (ones: the
        softmax sum comes out of the MMA, no shuffles)."""
        x = _u32_pairs(pairs)  # [tp, g, b0]
        x = gl.join(x, gl.full(x.shape, 1.0, gl.float16, layout=x.type.layout))  # [tp, g, b0, row bit 3]
        x = gl.reshape(gl.permute(x, [3, 1, 0, 2]), [CHUNK_C, CHUNK_C])
        return gl.convert_layout(x, A_OP, assert_trivial=True)
