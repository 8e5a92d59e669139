"""Where a 16-token chunk of a page lands in mma.m16n8k16 fragments, for `decode_direct.py`: the
distributed layouts each thread loads its bytes in, the relabelings that turn them into MMA operands
without moving data, and 8-bit codes to fp16 two per instruction (Gluon; GPU only).

- K is the A operand [16 tokens, D] of S^T = K . q^T: a thread holds, of tokens lane/4 and
  lane/4 + 8, the channel pairs {2t, 2t+1, 2t+8, 2t+9} of every 16-channel k-step (t = lane % 4). A
  dot product does not care about channel order, so logical channel k is memory channel
      c = (D/4) t + 4 j + 2 ph + pl    for k = 16 j + 8 ph + 2 t + pl
  and each thread's D/4 memory channels of a token are contiguous (16-byte loads). q^T (the B
  operand [D, 8]) takes the same permutation. With SEC, c = 64 (j // 4) + 16 t + 4 (j % 4) + 2 ph + pl
  instead: the 4 threads of a token read 64 contiguous bytes per load (whole sectors).
- V^T is the A operand [D, 16 tokens] of O^T = V^T . P^T: a thread holds tokens {2t, 2t+1, 2t+8,
  2t+9} and logical channels m = lane/4 + 8 i, memory channel c = (D/8) (lane/4) + i: D/8
  contiguous bytes per token.
Relabelings that must move nothing are checked at compile time (`assert_trivial=True`).
"""
try:  # Gluon ships with Triton >= 3.5 (its API is young: a version whose layouts differ disables it)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
    A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
    B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
    HAVE_GLUON = True
except (ImportError, AttributeError, TypeError):  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

CHUNK = 16  # tokens per MMA step (the M/K extent of one mma.m16n8k16 fragment)

if HAVE_GLUON:
    CHUNK_C = gl.constexpr(CHUNK)

    @gluon.constexpr_function
    def pack_lines(regs: list, row_bytes: int, hint: str = "") -> str:
        """PTX loading all of a thread's 32-bit words of a [rows, words] tile whose layout has register
        bases `regs` ([row, word] each), rows `row_bytes` apart, as one inline-asm pack: vector loads at
        immediate offsets from the first word's address (the last operand; the pack's other addresses go
        unused and ptxas drops their arithmetic); `hint` a load qualifier such as ".L2::128B"."""
        vec = 1
        while vec < 4 and vec.bit_length() - 1 < len(regs) and regs[vec.bit_length() - 1] == [0, vec]:
            vec *= 2  # registers that are contiguous words
        n = 1 << len(regs)
        lines = []
        for g in range(0, n, vec):
            off = sum(regs[i][0] * row_bytes + 4 * regs[i][1] for i in range(len(regs)) if g >> i & 1)
            outs = ", ".join(f"${g + j}" for j in range(vec))
            lines.append(f"ld.global{hint}.v{vec}.u32 {{{outs}}}, [${n}+{off}];" if vec > 1 else
                         f"ld.global{hint}.u32 {outs}, [${n}+{off}];")
        return " ".join(lines)

    @gluon.constexpr_function
    def _k_bases(D, WORDS, SEC):
        """(register, lane) bases of k_layout."""
        unit = 4 if WORDS else 1  # channels per element
        per = D // 4 // unit  # elements per thread per token
        if SEC:
            run = 16 // unit  # elements of one 16-byte run
            regs = [[0, 1 << i] for i in range(run.bit_length() - 1)]
            regs = regs + [[0, (64 // unit) << i] for i in range((D // 64).bit_length() - 1)]
            lanes = [[0, run], [0, 2 * run]]
        else:
            regs = [[0, 1 << i] for i in range(per.bit_length() - 1)]
            lanes = [[0, per], [0, 2 * per]]
        return regs + [[8, 0]], lanes + [[1, 0], [2, 0], [4, 0]]

    @gluon.constexpr_function
    def _v_bases(D, WORDS):
        """(register, lane) bases of v_layout."""
        per = D // 32 if WORDS else D // 8
        return ([[0, 1 << i] for i in range(per.bit_length() - 1)] + [[1, 0], [8, 0]],
                [[2, 0], [4, 0], [0, per], [0, 2 * per], [0, 4 * per]])

    @gluon.constexpr_function
    def k_layout(D, WORDS, SEC=False):
        """[16 tokens, D memory channels] (or [16, D/4] 32-bit words with WORDS): a thread holds D/4
        channels of tokens lane/4 and lane/4 + 8 (see the module docstring). SEC: as D/64 runs of 16
        contiguous channels, 64 apart, so the 4 threads of a token read 64 contiguous bytes per
        16-byte load (whole 32-byte sectors; else each load takes half of every sector of a row and
        the next load asks for the same sectors again)."""
        regs, lanes = _k_bases(D, WORDS, SEC)
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[], block_bases=[],
                                          shape=[CHUNK_C, D // 4 if WORDS else D])

    @gluon.constexpr_function
    def v_layout(D, WORDS):
        """[16 tokens, D memory channels] (or [16, D/4] words): a thread holds D/8 contiguous
        channels (from (D/8) * (lane/4)) of tokens 2t, 2t+1, 2t+8, 2t+9."""
        regs, lanes = _v_bases(D, WORDS)
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[], block_bases=[],
                                          shape=[CHUNK_C, D // 4 if WORDS else D])

    @gluon.jit
    def k_logical(x, D: gl.constexpr, SEC: gl.constexpr = False):
        """[16 rows, D] in k_layout (memory channel order) -> the same registers in logical channel
        order, k = 16 j + 8 ph + 2 t + pl for memory channel (D/4) t + 4 j + 2 ph + pl, or with SEC
        64 (j // 4) + 16 t + 4 (j % 4) + 2 ph + pl (nothing moves)."""
        if SEC:
            y = gl.permute(gl.reshape(x, [CHUNK_C, D // 64, 4, 4, 2, 2]), [0, 1, 3, 4, 2, 5])
        else:
            y = gl.permute(gl.reshape(x, [CHUNK_C, 4, D // 16, 2, 2]), [0, 2, 3, 1, 4])
        return gl.reshape(y, [CHUNK_C, D])


    @gluon.jit
    def k_operand(x, D: gl.constexpr, SEC: gl.constexpr = False):
        """K [16 tokens, D] in k_layout -> the A operand of S^T = K . q^T (registers reordered only)."""
        return gl.convert_layout(k_logical(x, D, SEC), A_OP, assert_trivial=True)


    @gluon.jit
    def v_operand(x, D: gl.constexpr):
        """fp16 [16, D] in v_layout -> V^T [D, 16] as the A operand, logical channel m = g + 8 i for
        memory channel (D/8) g + i (only registers are reordered: each pair of tokens is packed)."""
        x = gl.reshape(gl.permute(gl.reshape(x, [CHUNK_C, 8, D // 8]), [0, 2, 1]), [CHUNK_C, D])
        return gl.convert_layout(gl.permute(x, [1, 0]), A_OP)


    @gluon.constexpr_function
    def pack_constraints(layout):
        n = 1 << len(layout.reg_bases)
        return ",".join(["=r"] * n + ["l"] * n)

    @gluon.constexpr_function
    def l2_hint(nbytes):
        return f".L2::{nbytes}B"

    @gluon.constexpr_function
    def pack_asm(layout, row_bytes, hint):
        return pack_lines(layout.reg_bases, row_bytes, hint)

    @gluon.jit
    def load_pack(p, LAYOUT: gl.constexpr, ROW_BYTES: gl.constexpr, HINT: gl.constexpr):
        """uint32 [rows, words] at the pointers p (in LAYOUT, a DistributedLinearLayout; rows ROW_BYTES
        apart; HINT a load qualifier or ""): one inline-asm pack of vector loads a thread (`pack_lines`)."""
        N: gl.constexpr = 2 ** len(LAYOUT.reg_bases)
        return gl.inline_asm_elementwise(asm=pack_asm(LAYOUT, ROW_BYTES, HINT), constraints=pack_constraints(LAYOUT),
                                         args=[p], dtype=gl.uint32, is_pure=True, pack=N)

    @gluon.constexpr_function
    def load_hint(l2_bytes, l1_no_allocate):
        """The qualifiers of a page load: L1 not allocated (the bytes are read once), L2 fetching
        l2_bytes around a miss (0: neither said)."""
        return (".L1::no_allocate" if l1_no_allocate else "") + (l2_hint(l2_bytes) if l2_bytes else "")

    @gluon.jit
    def load_words(p, D: gl.constexpr, V: gl.constexpr, SEC: gl.constexpr, L2PF: gl.constexpr,
                   L1NA: gl.constexpr = False):
        """uint32 words [16, D/4] of a chunk's K (V: V) codes at the pointers p (k_layout(D, True, SEC),
        or v_layout(D, True) with V; a token's codes are D bytes): a plain load, or one pack a
        thread with qualifiers Triton's own loads never emit: L2PF, L2 fetches that many bytes around
        a miss (ld.global.L2::<n>B); L1NA, no L1 line is allocated (ld.global.L1::no_allocate)."""
        if L2PF == 0 and not L1NA:
            w = gl.load(p)
        elif V:
            w = load_pack(p, v_layout(D, True), D, load_hint(L2PF, L1NA))
        else:
            w = load_pack(p, k_layout(D, True, SEC), D, load_hint(L2PF, L1NA))
        return w

    @gluon.jit
    def pairs_fp16(w):
        """uint32 [N, W] of fp16 pairs -> fp16 [N, 2W] (low half first); only registers are renamed."""
        return gl.reshape(gl.join((w & 0xFFFF).to(gl.uint16), (w >> 16).to(gl.uint16)),
                          [w.shape[0], 2 * w.shape[1]]).to(gl.float16, bitcast=True)


    @gluon.jit
    def codes_fp16(w, FMT: gl.constexpr, OFFSET: gl.constexpr):
        """uint32 [16, D/4] words of four 8-bit codes -> fp16 [16, D], exact and two codes per
        instruction: e4m3 by the hardware pair conversion, e5m2 as the high byte of each half, int8
        as fp16(0x6400 | code ^ 0x80) = code + 1152 (no integer-to-float conversion), less 1152 unless
        OFFSET (keys: the caller takes 1152 x sum(q) off the scores once). The pages are carried across
        loop iterations as words: carried as bytes, each would take a register."""
        if FMT == 3:
            asm: gl.constexpr = """{ .reg .b16 l, h; mov.b32 {l, h}, $2;
                cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }"""
        elif FMT == 4:
            asm: gl.constexpr = "prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424;"
        elif OFFSET:
            asm: gl.constexpr = """{ .reg .b32 x; xor.b32 x, $2, 0x80808080;
                prmt.b32 $0, x, 0x64646464, 0x5140; prmt.b32 $1, x, 0x64646464, 0x7362; }"""
        else:
            asm: gl.constexpr = """{ .reg .b32 x, c; xor.b32 x, $2, 0x80808080; mov.b32 c, 0x64806480;
                prmt.b32 $0, x, 0x64646464, 0x5140; prmt.b32 $1, x, 0x64646464, 0x7362;
                sub.rn.f16x2 $0, $0, c; sub.rn.f16x2 $1, $1, c; }"""
        lo, hi = gl.inline_asm_elementwise(asm=asm, constraints="=r,=r,r", args=[w],
                                           dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)
        x = gl.join(gl.reshape(pairs_fp16(lo), [w.shape[0], w.shape[1], 2]),
                    gl.reshape(pairs_fp16(hi), [w.shape[0], w.shape[1], 2]))  # [16, D/4, 2 (pair), 2]
        return gl.reshape(gl.permute(x, [0, 1, 3, 2]), [w.shape[0], 4 * w.shape[1]])


    @gluon.jit
    def to_fp16(x, valid_rows):
        """A bf16 tile [16, D] -> (fp16 tile, power-of-two factor f) with tile = fp16(x / f): bf16's
        8-bit significands fit fp16's 11, so only the range needs care; f keeps the largest value
        <= 2**14 (exact: a power of two), and the caller multiplies f back into a scale."""
        x = gl.where(valid_rows[:, None], x.to(gl.float32), 0.0)
        amax = gl.max(gl.max(gl.abs(x), axis=1), axis=0)
        f = gl.exp2(gl.maximum(gl.ceil(gl.log2(gl.maximum(amax, 1.0) / 16384.0)), 0.0))
        return (x * (1.0 / f)).to(gl.float16), f


    @gluon.jit
    def tail_rows(k_new, v_new, res_k, t0, n_tail, tk, ck, tv, cv, KVH: gl.constexpr, BS: gl.constexpr,
                  D: gl.constexpr, BF16: gl.constexpr):
        """Rows t0..t0+15 of a sequence's full-precision tail: the residual tokens (< n_tail, from the
        slot's K rows at res_k, V rows KVH * BS * D further) and the new token (row n_tail, k_new /
        v_new [D]), K [16, D] in tk/ck's layout and V in tv/cv's, zero past the new token. Returns
        (k, v, fk, fv): fp16 tiles and their power-of-two factors (to_fp16; 1 for an fp16 model)."""
        rows_k = t0 + tk
        rows_v = t0 + tv
        pk = gl.where((rows_k == n_tail)[:, None], k_new + ck[None, :], res_k + (rows_k * D)[:, None] + ck[None, :])
        pv = gl.where((rows_v == n_tail)[:, None], v_new + cv[None, :],
                      res_k + KVH * BS * D + (rows_v * D)[:, None] + cv[None, :])
        kf = gl.load(pk, mask=(rows_k <= n_tail)[:, None], other=0.0)
        vf = gl.load(pv, mask=(rows_v <= n_tail)[:, None], other=0.0)
        fk = 1.0
        fv = 1.0
        if BF16:
            kf, fk = to_fp16(kf, rows_k <= n_tail)
            vf, fv = to_fp16(vf, rows_v <= n_tail)
        return kf.to(gl.float16), vf.to(gl.float16), fk, fv

    @gluon.jit
    def halves(x):
        """[16, N] -> its rows 0-7 [8, N], where the row + 8 bit is a register bit (nothing moves)."""
        lo, hi = gl.split(gl.permute(gl.reshape(x, [2, 8, x.shape[1]]), [1, 2, 0]))
        return lo

    @gluon.jit
    def q_operand(x, NH: gl.constexpr):
        """fp16 q [16 head rows, D] in logical channel order -> the B operand q^T [D, NH]: rows 8-15
        (padding) drop out at NH 8 (nothing moves); both n-tiles at NH 16."""
        if NH == 8:
            op = gl.convert_layout(gl.permute(halves(x), [1, 0]), B_OP, assert_trivial=True)
        else:
            op = gl.convert_layout(gl.permute(x, [1, 0]), B_OP)
        return op
