"""The INT4 format's Triton code, write and read side together (layout and math in `kv/layout.py`,
torch reference in `kv/quant.py`, byte-identical): x = q * s + m, keys per channel over the block,
values per token in groups of 32 channels, each group's (s, m) an 8-bit code pair against a bf16
(m_base, m_step, s_step) header per (block, layer, head, K|V)."""
import triton
import triton.language as tl


HEADER = tl.constexpr(16)  # bytes of the K and V headers at the start of each K record
STEP_FLOOR = tl.constexpr(5.960464477539063e-08)  # 2**-24, quant.INT4_STEP_FLOOR


@triton.jit
def int4_code(x, m, inv):
    """round_half_even((x - m) * inv) as uint32: adding 1.5 * 2**23 puts the integer in the low
    mantissa bits (no F2I). No upper clamp needed: (x - m) * inv <= 15 * (1 + 2**-22) (layout.py).
    The max with 0 is a no-op (m <= x exactly) that keeps the multiply from fusing into the add: an
    fma would round the exact product once, quant.py rounds the product, then to an integer."""
    y = tl.maximum((x - m) * inv, 0.0) + 12582912.0
    return y.to(tl.uint32, bitcast=True) & 0xF


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
def _all(x, MAX: tl.constexpr):
    """Max (MAX) or min of a 2-D tile -> scalar."""
    if MAX:
        return tl.max(tl.max(x, axis=1), axis=0)
    else:
        return tl.min(tl.min(x, axis=1), axis=0)


@triton.jit
def _group_codes(pool_ptr, hdr_byte, lo, hi):
    """Group minima/maxima [A, B] -> (s codes, m codes uint8 [A, B], 1 / s, m fp32 [A, B]); stores the
    bf16 header (m_base, m_step, s_step, 0) at byte `hdr_byte`. Same operations as quant._int4_group_codes."""
    m_base = _bf16_round(_all(lo, False), False)
    m_step = _bf16_round(tl.maximum(tl.math.div_rn(_all(lo, True) - m_base, 255.0), STEP_FLOOR), True)
    cm = tl.minimum(tl.floor((lo - m_base) * tl.math.div_rn(1.0, m_step)), 255.0)  # >= 0: m_base <= lo
    cm = tl.where(cm * m_step + m_base > lo, cm - 1.0, cm)  # the reciprocal rounded up: m <= lo exactly
    m = cm * m_step + m_base  # code * step is exact in fp32: an FMA rounds the same as mul + add
    span = hi - m
    s_step = _bf16_round(tl.maximum(tl.math.div_rn(_all(span, True), 3825.0), STEP_FLOOR), True)
    cs = tl.minimum(tl.maximum(tl.ceil(span * tl.math.div_rn(1.0, s_step * 15.0)), 1.0), 255.0)
    i = tl.arange(0, 4)
    h = tl.where(i == 0, m_base, tl.where(i == 1, m_step, tl.where(i == 2, s_step, 0.0)))
    ph = pool_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
    tl.store(ph + hdr_byte // 2 + i, (h.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16))  # one 8-byte store
    return cs.to(tl.uint8), cm.to(tl.uint8), tl.math.div_rn(1.0, cs * s_step), m


@triton.jit
def _pairs(x, BITS: tl.constexpr):
    """[R, C] uint32 -> [R, C // 2]: element 2i | element 2i + 1 << BITS."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
    return a | (b << BITS)


@triton.jit
def _store_nibbles(pool_ptr, base, head, q, BS: tl.constexpr, D: tl.constexpr):
    """q uint32 [BS, D] codes 0..15 -> [BS, D // 2] bytes, low nibble = even channel, stored as
    little-endian 32-bit words [BS, D // 8]."""
    w = _pairs(_pairs(_pairs(q, 4), 8), 16)
    t = tl.arange(0, BS)
    j = tl.arange(0, D // 8)
    p32 = pool_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    tl.store(p32 + base // 4 + (head * BS + t)[:, None] * (D // 8) + j[None, :], w)


@triton.jit
def store_int4_k(pool_ptr, base, krec_base, head, x, BS: tl.constexpr, D: tl.constexpr):
    """Keys [BS, D] fp32 per channel over the block. krec_base: byte offset of the K scale region;
    this head's record is [K header | V header | s codes [D] | m codes [D]]."""
    rec = krec_base + head * (HEADER + 2 * D)
    lo = tl.min(x, axis=0, keep_dims=True)  # [1, D]
    hi = tl.max(x, axis=0, keep_dims=True)
    cs, cm, inv, m = _group_codes(pool_ptr, rec, lo, hi)
    _store_nibbles(pool_ptr, base, head, int4_code(x, m, inv), BS, D)
    j = tl.arange(0, D // 4)[None, :]  # codes as 32-bit words: no byte-wise layout shuffle
    p32 = pool_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + (rec + HEADER) // 4
    tl.store(p32 + j, _pairs(_pairs(cs.to(tl.uint32), 8), 16))
    tl.store(p32 + D // 4 + j, _pairs(_pairs(cm.to(tl.uint32), 8), 16))


@triton.jit
def store_int4_v(pool_ptr, base, scale_base, krec_base, head, x, BS: tl.constexpr, D: tl.constexpr):
    """Values [BS, D] fp32 per token in groups of 32 channels: codes [BS, 2, G] at scale_base, the
    header in this head's K record (byte 8)."""
    G: tl.constexpr = D // 32
    x3 = tl.reshape(x, (BS, G, 32))
    cs, cm, inv, m = _group_codes(pool_ptr, krec_base + head * (HEADER + 2 * D) + 8,
                                  tl.min(x3, axis=2), tl.max(x3, axis=2))  # [BS, G]
    q = int4_code(x3, m[:, :, None], inv[:, :, None])
    _store_nibbles(pool_ptr, base, head, tl.reshape(q, (BS, D)), BS, D)
    codes = tl.reshape(tl.permute(tl.join(cs, cm), (0, 2, 1)), (BS, 2 * G))  # per token: s codes, m codes
    t = tl.arange(0, BS)
    c = tl.arange(0, 2 * G)
    tl.store(pool_ptr + scale_base + (head * BS + t)[:, None] * (2 * G) + c[None, :], codes)


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
    head -> [N, D] in DOT: q * s + m with (s, m) decoded from the codes, all in DOT (fp16 on the GPU:
    packed half2 math, fp16 rounding like the fp16 dot operands themselves)."""
    m2 = n_mask[:, None]
    HALF: tl.constexpr = D // 2
    N: tl.constexpr = row.shape[0]
    j = tl.arange(0, HALF)
    b = tl.load(pool_ptr + (base + DATA_OFF + row * HALF)[:, None] + j[None, :], mask=m2, other=0)
    q = tl.reshape(tl.join(_nibble(b & 0xF, DOT), _nibble(b >> 4, DOT)), (N, D))  # [N, D]
    if IS_KEY:  # record [K header | V header | s codes [D] | m codes [D]] per head, per channel
        rec = base + SCALE_OFF + head * (HEADER + 2 * D)
        m_base, m_step, s_step = _header(pool_ptr, rec, n_mask, DOT)
        d = tl.arange(0, D)
        cs = tl.load(pool_ptr + (rec + HEADER)[:, None] + d[None, :], mask=m2, other=0)
        cm = tl.load(pool_ptr + (rec + HEADER + D)[:, None] + d[None, :], mask=m2, other=0)
        x = q * (_code(cs, DOT) * s_step) + (_code(cm, DOT) * m_step + m_base)
    else:  # codes [KVH, BS, 2, G] per token and 32 channels; the header sits in the K record, and
        # the K scale region starts at 2 * DATA_OFF (layout: [K data | V data | K scales | ...])
        G: tl.constexpr = D // 32
        F32: tl.constexpr = tl.float32  # (s, m) per 32 channels: cheap in fp32, rounded once to DOT
        m_base, m_step, s_step = _header(pool_ptr, base + 2 * DATA_OFF + head * (HEADER + 2 * D) + 8, n_mask, F32)
        g = tl.arange(0, G)
        cb = (base + SCALE_OFF + row * (2 * G))[:, None] + g[None, :]
        s = (_code(tl.load(pool_ptr + cb, mask=m2, other=0), F32) * s_step).to(DOT)  # [N, G]
        m = (_code(tl.load(pool_ptr + cb + G, mask=m2, other=0), F32) * m_step + m_base).to(DOT)
        x = tl.reshape(tl.reshape(q, (N, G, 32)) * s[:, :, None] + m[:, :, None], (N, D))
    return x
