"""The INT4 format's Triton code, write and read side together (layout and math in `kv/layout.py`,
torch reference in `kv/quant.py`, byte-identical): keys symmetric per channel over the block, x =
(q - 7.5) s, each s an 8-bit code against a bf16 s_step; values x = q s + m per token in groups of 32
channels, each group's (s, m) an 8-bit code pair against a bf16 (m_base, m_step, s_step) header.
Headers are per (block, layer, head, K|V)."""
import triton
import triton.language as tl


HEADER = tl.constexpr(16)  # bytes of the K and V headers at the start of each K record
STEP_FLOOR = tl.constexpr(5.960464477539063e-08)  # 2**-24, quant.INT4_STEP_FLOOR
K_OFFSET = tl.constexpr(7.5)  # keys: x = (q - 7.5) s (layout.INT4_K_OFFSET)


@triton.jit
def _bits(y):
    """Round half-even an fp32 0 <= y < 2**22 by adding 1.5 * 2**23 (no F2I): the integer lands in the
    low mantissa bits, bits up to 21 above it stay zero (`_pack` relies on that), 0x4B4 sits above.
    The kernel is compiled without fp fusion (`enable_fp_fusion=False`): an fma of the product that
    feeds y would round once where quant.py rounds the product, then to an integer."""
    return (y + 12582912.0).to(tl.uint32, bitcast=True)


@triton.jit
def _pack(x, BITS: tl.constexpr):
    """Codes from `_bits` (BITS = 4 or 8 wide), any shape -> 1-D little-endian words, in x's order.
    Shift-and-add (one LEA a level) needs no masks: bits BITS..21 of every code are zero, so the
    garbage above bit 21 never reaches bits 0..15; the last level keeps 16 bits of each half."""
    a, b = tl.split(tl.reshape(x, (x.numel // 2, 2)))
    x = a + (b << BITS)
    if BITS == 4:  # nibble pairs -> 16 bits
        a, b = tl.split(tl.reshape(x, (x.numel // 2, 2)))
        x = a + (b << 8)
    a, b = tl.split(tl.reshape(x, (x.numel // 2, 2)))
    return (a & 0xFFFF) | (b << 16)


@triton.jit
def code_slot(c):
    """Byte of channel c's code in a K record's s codes: channels 2-3 and 4-5 of each eight
    swap places (bits 1 and 2 of c), so a word holds the channel pairs (c, c + 4) the register-direct
    kernel's operands pair up (kv/layout.py)."""
    return (c & -8) | (c & 1) | ((c & 2) << 1) | ((c & 4) >> 1)


@triton.jit
def _code_order(x, D: tl.constexpr):
    """[HP, D] codes in channel order -> in record order (`code_slot`; the swap is its own inverse)."""
    HP: tl.constexpr = x.shape[0]
    x = tl.permute(tl.reshape(x, (HP, D // 8, 2, 2, 2)), (0, 1, 3, 2, 4))  # [h, e, bit 2, bit 1, bit 0] -> 1, 2
    return tl.reshape(x, (HP, D))


@triton.jit
def _bf16_round(x, UP: tl.constexpr):
    """fp32 -> a bf16 value as fp32, toward +inf (UP, x >= 0) or -inf, by integer ops on the bits."""
    b = x.to(tl.int32, bitcast=True)
    if UP:
        b = b + 0xFFFF
    else:
        b = b + tl.where(b < 0, 0xFFFF, 0)  # a negative value rounds its magnitude up
    return (b & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minmax_dtype(x):
    """fp16 stays (min/max are exact in it: packed fp16 pairs, where tl.min/tl.max would widen to fp32
    first); bf16 widens to fp32 (Triton computes bf16 min in fp32, which a bf16 reduction rejects)."""
    if x.dtype == tl.float16:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def _lohi(x, axis: tl.constexpr):
    """Min and max of x over `axis`, exact (see `_minmax_dtype`)."""
    x = _minmax_dtype(x)
    return tl.reduce(x, axis, _min2), tl.reduce(x, axis, _max2)


@triton.jit
def _per_head(x, MAX: tl.constexpr):
    """Max (MAX) or min of [R, HP, C] over R and C -> [1, HP, 1]."""
    if MAX:
        return tl.max(tl.max(x, axis=2, keep_dims=True), axis=0, keep_dims=True)
    else:
        return tl.min(tl.min(x, axis=2, keep_dims=True), axis=0, keep_dims=True)


@triton.jit
def _group_codes(pool_ptr, rec, lo, hi):
    """Value group minima/maxima [R, HP, C] fp32 of HP heads -> (s codes, m codes from `_bits` [R, HP, C],
    1 / s, m fp32 [R, HP, C]); stores each head's bf16 header (m_base, m_step, s_step, 0) at byte
    rec [1, HP, 1]. Same operations as quant._int4_group_codes."""
    m_base = _bf16_round(_per_head(lo, False), False)  # [1, HP, 1]
    m_step = _bf16_round(tl.maximum(tl.math.div_rn(_per_head(lo, True) - m_base, 255.0), STEP_FLOOR), True)
    cm = tl.minimum(tl.floor((lo - m_base) * tl.math.div_rn(1.0, m_step)), 255.0)  # >= 0: m_base <= lo
    cm = tl.where(cm * m_step + m_base > lo, cm - 1.0, cm)  # the reciprocal rounded up: m <= lo exactly
    m = cm * m_step + m_base  # code * step is exact in fp32: mul + add rounds once, like an FMA
    span = hi - m
    s_step = _bf16_round(tl.maximum(tl.math.div_rn(_per_head(span, True), 3825.0), STEP_FLOOR), True)
    cs = tl.minimum(tl.maximum(tl.ceil(span * tl.math.div_rn(1.0, s_step * 15.0)), 1.0), 255.0)
    i = tl.arange(0, 4)[None, None, :]
    h = tl.where(i == 0, m_base, tl.where(i == 1, m_step, tl.where(i == 2, s_step, 0.0)))  # [1, HP, 4]
    ph = pool_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
    tl.store(ph + rec // 2 + i, (h.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16))  # 8 bytes a head
    return _bits(cs), _bits(cm), tl.math.div_rn(1.0, cs * s_step), m


@triton.jit
def _key_codes(pool_ptr, rec, a):
    """Channel absmaxima a [1, HP, D] fp32 -> (s codes from `_bits`, 1 / s) [1, HP, D]; stores each
    head's bf16 K header (0, 0, s_step, 0) at byte rec [1, HP, 1]. Same operations as
    quant._int4_key_group_codes."""
    s_step = _bf16_round(tl.maximum(tl.math.div_rn(_per_head(a, True), K_OFFSET * 255.0), STEP_FLOOR), True)
    cs = tl.minimum(tl.maximum(tl.ceil(a * tl.math.div_rn(1.0, s_step * K_OFFSET)), 1.0), 255.0)
    i = tl.arange(0, 4)[None, None, :]
    h = tl.where(i == 2, s_step, 0.0)  # [1, HP, 4]
    ph = pool_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
    tl.store(ph + rec // 2 + i, (h.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16))  # 8 bytes a head
    return _bits(cs), tl.math.div_rn(1.0, cs * s_step)


@triton.jit
def _store_words(pool_ptr, byte_base, head0, w, BS: tl.constexpr, ROW_WORDS: tl.constexpr):
    """Words w [BS, HP * ROW_WORDS] (HP heads side by side) -> rows of a [KVH, BS, ROW_WORDS] region."""
    t = tl.arange(0, BS)[:, None]
    c = tl.arange(0, w.shape[1])[None, :]
    p32 = pool_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    tl.store(p32 + byte_base // 4 + ((head0 + c // ROW_WORDS) * BS + t) * ROW_WORDS + c % ROW_WORDS, w)


@triton.jit
def store_int4_k(pool_ptr, base, krec_base, head0, xr, BS: tl.constexpr, D: tl.constexpr, HP: tl.constexpr):
    """Keys xr [BS, HP * D] of heads head0.. (input dtype), symmetric per channel over the block.
    krec_base: byte offset of the K scale region; each head's record is [K header | V header | s codes [D]]."""
    hh = tl.arange(0, HP)
    rec = krec_base + (head0 + hh) * (HEADER + D)  # [HP] bytes
    lo, hi = _lohi(xr, 0)  # [HP * D]
    a = tl.maximum(tl.abs(lo.to(tl.float32)), tl.abs(hi.to(tl.float32)))
    cs, inv = _key_codes(pool_ptr, rec[None, :, None], tl.reshape(a, (1, HP, D)))
    q = _bits(xr.to(tl.float32) * tl.reshape(inv, (1, HP * D)) + K_OFFSET)  # the product rounds, then the sum
    _store_words(pool_ptr, base, head0, tl.reshape(_pack(q, 4), (BS, HP * D // 8)), BS, D // 8)
    j = tl.arange(0, D // 4)[None, :]  # codes as 32-bit words
    p32 = pool_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + ((rec + HEADER) // 4)[:, None] + j  # [HP, D // 4]
    tl.store(p32, tl.reshape(_pack(_code_order(tl.reshape(cs, (HP, D)), D), 8), (HP, D // 4)))


@triton.jit
def store_int4_v(pool_ptr, base, scale_base, krec_base, head0, xr, BS: tl.constexpr, D: tl.constexpr,
                 HP: tl.constexpr):
    """Values xr [HP * G, BS, 4, 8] of heads head0.. (input dtype; [g, t, j, e] = channel 32 g + 8 j + e
    of token t, so a thread holds whole 32-channel groups), per token and group: codes [KVH, BS, 2, G]
    at scale_base, each head's header in its K record (byte 8)."""
    G: tl.constexpr = D // 32
    xm = _minmax_dtype(xr)
    lo = tl.reduce(tl.reduce(xm, 3, _min2), 2, _min2)  # [HP * G, BS], exact
    hi = tl.reduce(tl.reduce(xm, 3, _max2), 2, _max2)
    lo = tl.reshape(tl.trans(lo), (BS, HP, G)).to(tl.float32)
    hi = tl.reshape(tl.trans(hi), (BS, HP, G)).to(tl.float32)
    hh = tl.arange(0, HP)
    rec = krec_base + (head0 + hh) * (HEADER + D) + 8
    cs, cm, inv, m = _group_codes(pool_ptr, rec[None, :, None], lo, hi)  # [BS, HP, G]
    m4 = tl.trans(tl.reshape(m, (BS, HP * G)))[:, :, None, None]
    inv4 = tl.trans(tl.reshape(inv, (BS, HP * G)))[:, :, None, None]
    w = tl.reshape(_pack(_bits((xr.to(tl.float32) - m4) * inv4), 4), (HP * G, BS, 4))  # [g, t, j]: 8 channels
    g = tl.arange(0, HP * G)[:, None, None]
    t = tl.arange(0, BS)[None, :, None]
    j = tl.arange(0, 4)[None, None, :]
    p32 = pool_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    tl.store(p32 + base // 4 + ((head0 + g // G) * BS + t) * (D // 8) + (g % G) * 4 + j, w)
    codes = tl.reshape(tl.permute(tl.join(cs, cm), (0, 1, 3, 2)), (BS, HP * 2 * G))  # per token: s, then m codes
    if G % 2 == 0:
        _store_words(pool_ptr, scale_base, head0, tl.reshape(_pack(codes, 8), (BS, HP * G // 2)), BS, G // 2)
    else:  # 2G bytes a token is no whole number of words
        t = tl.arange(0, BS)[:, None]
        c = tl.arange(0, HP * 2 * G)[None, :]
        tl.store(pool_ptr + scale_base + ((head0 + c // (2 * G)) * BS + t) * (2 * G) + c % (2 * G),
                 codes.to(tl.uint8))


@triton.jit
def _header(pool_ptr, byte, n_mask, DOT: tl.constexpr):
    """bf16 (m_base, m_step, s_step) at byte offsets [N] (8-aligned) -> m_base, m_step * C, s_step * C
    as [N, 1] in DOT, C = _code's scale (fp16: 256, so steps down to 2**-22 stay normal)."""
    h = tl.load(pool_ptr.to(tl.pointer_type(tl.uint64), bitcast=True) + byte // 8, mask=n_mask, other=0)
    m_base = (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    m_step = ((h >> 16).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    s_step = ((h >> 32).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    C: tl.constexpr = 256.0 if DOT == tl.float16 else 1.0
    return m_base.to(DOT)[:, None], (m_step * C).to(DOT)[:, None], (s_step * C).to(DOT)[:, None]


@triton.jit
def _code(c, DOT: tl.constexpr):
    """8-bit codes -> c / C in DOT, exact, by bits (no int-to-float instructions): fp16(0x4400 | c) =
    4 + c / 256 (C = 256), fp32(0x4B000000 | c) = 2**23 + c (C = 1)."""
    if DOT == tl.float16:
        return (c.to(tl.uint16) | 0x4400).to(tl.float16, bitcast=True) - 4.0
    else:
        return (c.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _nibble(c, DOT: tl.constexpr):
    """4-bit codes -> DOT, exact: fp16(0x6400 | c) = 1024 + c, fp32(0x4B000000 | c) = 2**23 + c."""
    if DOT == tl.float16:
        return (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        return (c.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def load_int4_tile(pool_ptr, base, row, n_mask, head, DATA_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
                   IS_KEY: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr):
    """Rows `row` [N] (of [KVH, BS]) of the pages' layer regions at byte offsets `base` [N], one KV
    head -> [N, D] in DOT: (q - 7.5) s (keys) or q * s + m (values) with (s, m) decoded from the
    codes, all in DOT (fp16 on the GPU: packed half2 math, fp16 rounding like the fp16 dot operands
    themselves)."""
    m2 = n_mask[:, None]
    HALF: tl.constexpr = D // 2
    N: tl.constexpr = row.shape[0]
    j = tl.arange(0, HALF)
    b = tl.load(pool_ptr + (base + DATA_OFF + row * HALF)[:, None] + j[None, :], mask=m2, other=0)
    q = tl.reshape(tl.join(_nibble(b & 0xF, DOT), _nibble(b >> 4, DOT)), (N, D))  # [N, D]
    if IS_KEY:  # record [K header | V header | s codes [D]] per head; (q - 7.5) s per channel
        rec = base + SCALE_OFF + head * (HEADER + D)
        _, _, s_step = _header(pool_ptr, rec, n_mask, DOT)
        cs = tl.load(pool_ptr + (rec + HEADER)[:, None] + code_slot(tl.arange(0, D))[None, :], mask=m2, other=0)
        x = (q - K_OFFSET) * (_code(cs, DOT) * s_step)
    else:  # codes [KVH, BS, 2, G] per token and 32 channels; the header sits in the K record, and
        # the K scale region starts at 2 * DATA_OFF (layout: [K data | V data | K scales | ...])
        G: tl.constexpr = D // 32
        F32: tl.constexpr = tl.float32  # (s, m) per 32 channels: cheap in fp32, rounded once to DOT
        m_base, m_step, s_step = _header(pool_ptr, base + 2 * DATA_OFF + head * (HEADER + D) + 8, n_mask, F32)
        g = tl.arange(0, G)
        cb = (base + SCALE_OFF + row * (2 * G))[:, None] + g[None, :]
        s = (_code(tl.load(pool_ptr + cb, mask=m2, other=0), F32) * s_step).to(DOT)  # [N, G]
        m = (_code(tl.load(pool_ptr + cb + G, mask=m2, other=0), F32) * m_step + m_base).to(DOT)
        x = tl.reshape(tl.reshape(q, (N, G, 32)) * s[:, :, None] + m[:, :, None], (N, D))
    return x
