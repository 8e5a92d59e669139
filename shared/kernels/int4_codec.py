"""The INT4 format's Triton code, write and read side together (layout in `kv/layout.py`):
keys per channel over the block, values per token in groups of 32 channels, x = q * s + m."""
import triton
import triton.language as tl

from kvmesh.kernels.formats import fp16_round_scale, rint_even


@triton.jit
def int4_code(x, m, s):
    return tl.minimum(tl.maximum(rint_even(tl.math.div_rn(x - m, s)), 0.0), 15.0).to(tl.int32)


@triton.jit
def store_int4_k(pool_ptr, base, scale_base, head, xe, xo, BS: tl.constexpr, D: tl.constexpr):
    """Keys per channel over the block: s, m [D] fp16. xe/xo: even/odd channels [BS, D // 2]."""
    HALF: tl.constexpr = D // 2
    me, mo = tl.min(xe, axis=0), tl.min(xo, axis=0)  # [HALF]
    se = fp16_round_scale(tl.maximum(tl.math.div_rn(tl.max(xe, axis=0) - me, 15.0), 1e-6))
    so = fp16_round_scale(tl.maximum(tl.math.div_rn(tl.max(xo, axis=0) - mo, 15.0), 1e-6))
    me = tl.minimum(tl.maximum(me, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    mo = tl.minimum(tl.maximum(mo, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    packed = int4_code(xe, me[None, :], se[None, :]) | (int4_code(xo, mo[None, :], so[None, :]) << 4)
    t = tl.arange(0, BS)
    j = tl.arange(0, HALF)
    tl.store(pool_ptr + base + (head * BS + t)[:, None] * HALF + j[None, :], packed.to(tl.uint8))
    ps = pool_ptr.to(tl.pointer_type(tl.float16), bitcast=True) + scale_base // 2 + head * 2 * D
    tl.store(ps + 2 * j, se.to(tl.float16))
    tl.store(ps + 2 * j + 1, so.to(tl.float16))
    tl.store(ps + D + 2 * j, me.to(tl.float16))
    tl.store(ps + D + 2 * j + 1, mo.to(tl.float16))


@triton.jit
def store_int4_v(pool_ptr, base, scale_base, head, xe, xo, BS: tl.constexpr, D: tl.constexpr):
    """Values per token in groups of 32 channels: s, m [BS, G] fp16."""
    HALF: tl.constexpr = D // 2
    G: tl.constexpr = D // 32
    xe3 = tl.reshape(xe, (BS, G, 16))
    xo3 = tl.reshape(xo, (BS, G, 16))
    lo = tl.minimum(tl.min(xe3, axis=2), tl.min(xo3, axis=2))  # [BS, G]
    hi = tl.maximum(tl.max(xe3, axis=2), tl.max(xo3, axis=2))
    s = fp16_round_scale(tl.maximum(tl.math.div_rn(hi - lo, 15.0), 1e-6))
    m = tl.minimum(tl.maximum(lo, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    qe = int4_code(xe3, m[:, :, None], s[:, :, None])
    qo = int4_code(xo3, m[:, :, None], s[:, :, None])
    packed = tl.reshape(qe | (qo << 4), (BS, HALF))
    t = tl.arange(0, BS)
    j = tl.arange(0, HALF)
    tl.store(pool_ptr + base + (head * BS + t)[:, None] * HALF + j[None, :], packed.to(tl.uint8))
    g = tl.arange(0, G)
    ps = pool_ptr.to(tl.pointer_type(tl.float16), bitcast=True) + scale_base // 2
    row = ((head * BS + t) * 2)[:, None] * G + g[None, :]  # [BS, G]
    tl.store(ps + row, s.to(tl.float16))
    tl.store(ps + row + G, m.to(tl.float16))


@triton.jit
def load_int4_tile(pool_ptr, base, row, n_mask, head, DATA_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
                   IS_KEY: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr):
    """Rows `row` [N] (of [KVH, BS]) of the pages' layer regions at byte offsets `base` [N], one KV
    head -> [N, D] in DOT: q * s + m, the scales gathered per element. Nibbles become fp16 by bits:
    fp16(0x6400 | nibble) - 1024 = q."""
    d = tl.arange(0, D)
    m2 = n_mask[:, None]
    HALF: tl.constexpr = D // 2
    j = tl.arange(0, HALF)
    b = tl.load(pool_ptr + (base + DATA_OFF + row * HALF)[:, None] + j[None, :], mask=m2, other=0)
    b = b.to(tl.uint16)
    lo = ((b & 0xF) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    hi = ((b >> 4) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    q = tl.reshape(tl.join(lo, hi), (lo.shape[0], D))  # [N, D], even/odd channels interleaved
    ps = pool_ptr.to(tl.pointer_type(tl.float16), bitcast=True)
    sb = (base + SCALE_OFF) // 2
    if IS_KEY:  # [KVH, 2, D]: per channel over the page
        so = (sb + head * 2 * D)[:, None] + d[None, :]
        s = tl.load(ps + so, mask=m2, other=0.0)
        mn = tl.load(ps + so + D, mask=m2, other=0.0)
    else:  # [KVH, BS, 2, D // 32]: per token, groups of 32 channels
        G: tl.constexpr = D // 32
        so = (sb + row * 2 * G)[:, None] + (d // 32)[None, :]
        s = tl.load(ps + so, mask=m2, other=0.0)
        mn = tl.load(ps + so + G, mask=m2, other=0.0)
    return q.to(DOT) * s.to(DOT) + mn.to(DOT)
