"""Quantize -> dequantize of whole KV blocks: error bounds per dtype and exact layout properties."""
from __future__ import annotations

import pytest
import torch

from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.kv.quant import dequantize_blocks, dequantize_layer, int4_key_codes, quantize_blocks, store_blocks

torch.set_num_threads(1)
N, BS, H, D = 5, 16, 3, 64


def fresh(scale: float = 1.0, seed: int | None = None):
    gen = torch.Generator()
    gen.seed() if seed is None else gen.manual_seed(seed)
    k = torch.randn(N, BS, H, D, generator=gen) * scale
    v = torch.randn(N, BS, H, D, generator=gen) * scale
    k[0, 3, 1, 7] = 40.0 * scale  # an outlier, as real keys have
    return k, v


def heads_major(x):
    return x.transpose(1, 2)  # [n, bs, H, D] -> [n, H, bs, D]


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_plain_dtypes_are_casts(name, dtype):
    k, v = fresh()
    dk, dv = dequantize_blocks(quantize_blocks(k, v, name), name)
    assert torch.equal(dk, heads_major(k).to(dtype).float())
    assert torch.equal(dv, heads_major(v).to(dtype).float())


@pytest.mark.parametrize("name,fmax,mant,sub", [("fp8_e4m3", 448.0, 3, 2.0 ** -9), ("fp8_e5m2", 57344.0, 2, 2.0 ** -16)])
def test_fp8_per_head_scale_and_error(name, fmax, mant, sub):
    k, v = fresh(scale=3.0)
    qb = quantize_blocks(k, v, name)
    for x, q, s in ((k, qb.k, qb.k_scale), (v, qb.v, qb.v_scale)):
        x = heads_major(x)
        want_s = x.abs().amax(dim=(2, 3)) / fmax  # [n, H]
        assert torch.equal(s, want_s)
        assert q.float().abs().amax(dim=(2, 3)).eq(fmax).all()  # the absmax element hits FMAX
        deq = q.float() * s[:, :, None, None]
        err = (deq - x).abs()
        bound = x.abs() * 2.0 ** -(mant + 1) + s[:, :, None, None] * sub / 2 + 1e-7
        assert (err <= bound).all(), (err - bound).max()
    dk, _ = dequantize_blocks(qb, name)
    assert torch.equal(dk, qb.k.float() * qb.k_scale[:, :, None, None])


def test_int8_per_token_exact():
    k, v = fresh()
    qb = quantize_blocks(k, v, "int8")
    for x, q, s in ((k, qb.k, qb.k_scale), (v, qb.v, qb.v_scale)):
        x = heads_major(x)
        assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (N, H, BS)
        want_s = (x.abs().amax(dim=3) / 127).to(torch.float16)
        assert torch.equal(s, want_s)
        want_q = torch.round(x / want_s.float()[..., None]).clamp(-127, 127).to(torch.int8)
        assert torch.equal(q, want_q)
        deq = q.float() * s.float()[..., None]  # q * s reproduces exactly what dequantize returns
        assert ((deq - x).abs() <= s.float()[..., None] * 0.501 + 1e-7).all()
        assert q.abs().amax(dim=3).ge(126).all()
    dk, dv = dequantize_blocks(qb, "int8")
    assert torch.equal(dk, qb.k.float() * qb.k_scale.float()[..., None])
    assert torch.equal(dv, qb.v.float() * qb.v_scale.float()[..., None])


def unpack(p):
    return torch.stack(((p & 15), (p >> 4)), -1).flatten(-2).float()


def int4_parts(qb):
    """Decode the int4 scale bytes: K and V headers [n, H, 4], K s codes, V codes (s, m)."""
    D = qb.k.shape[-1] * 2
    rec = qb.k_scale
    hk = rec[..., :8].contiguous().view(torch.bfloat16).float()  # [n, H, 4]
    hv = rec[..., 8:16].contiguous().view(torch.bfloat16).float()
    kc = int4_key_codes(rec).float()  # [n, H, D], channel order
    vc = (qb.v_scale[:, :, :, 0].float(), qb.v_scale[:, :, :, 1].float())  # [n, H, bs, G]
    return hk, hv, kc, vc


def check_int4_groups(x, q, h, cs, cm):
    """x [..., groups, size]: q codes, header [..., 4] (broadcast), codes [..., groups]: the
    stored (s, m) cover each group (m <= lo, m + 15 s >= hi) and q is round((x - m) / s)."""
    s = cs * h[..., 2]
    m = cm * h[..., 1] + h[..., 0]
    assert (h[..., 3] == 0).all() and (cs >= 1).all()
    lo, hi = x.amin(-1), x.amax(-1)
    assert (m <= lo).all()
    assert (m + 15 * s >= hi - s * 1e-4).all()  # fp32 roundings of the reciprocal (layout.py)
    assert torch.equal(q, torch.round((x - m[..., None]) * (1 / s[..., None])).clamp(0, 15))
    err = (q * s[..., None] + m[..., None] - x).abs()
    assert (err <= s[..., None] * 0.5001 + 1e-6).all()
    return s, m


def check_int4_keys(x, q, h, cs):
    """x [..., channels, tokens]: q codes, K header [..., 4] (broadcast), s codes [..., channels]: the
    symmetric levels (q - 7.5) s cover each channel (7.5 s >= absmax) and q is round(x / s + 7.5)."""
    s = cs * h[..., 2]
    assert (h[..., 0] == 0).all() and (h[..., 1] == 0).all() and (h[..., 3] == 0).all() and (cs >= 1).all()
    assert (7.5 * s >= x.abs().amax(-1) - s * 1e-4).all()  # fp32 roundings of the reciprocal (layout.py)
    assert torch.equal(q, torch.round(x * (1 / s[..., None]) + 7.5).clamp(0, 15))
    err = ((q - 7.5) * s[..., None] - x).abs()
    assert (err <= s[..., None] * 0.5001 + 1e-6).all()
    return s


def test_int4_groups_error_and_packing():
    k, v = fresh()
    qb = quantize_blocks(k, v, "int4")
    assert qb.k.shape == (N, H, BS, D // 2) and qb.k_scale.shape == (N, H, 16 + D)
    assert qb.v_scale.shape == (N, H, BS, 2, D // 32) and qb.k_scale.dtype == torch.uint8
    hk, hv, kcs, (vcs, vcm) = int4_parts(qb)
    xk, xv = heads_major(k), heads_major(v)
    # keys: one symmetric s code per channel over the block's tokens
    qk = unpack(qb.k)  # [n, H, bs, D]
    sk = check_int4_keys(xk.transpose(2, 3), qk.transpose(2, 3), hk[:, :, None], kcs)
    # values: per token, groups of 32 channels
    g = xv.reshape(N, H, BS, D // 32, 32)
    qv = unpack(qb.v).view(N, H, BS, D // 32, 32)
    sv, mv = check_int4_groups(g, qv, hv[:, :, None, None], vcs, vcm)
    # the headers: V's m_base is the lowest minimum rounded down; the steps span the codes
    assert (hv[..., 0] <= xv.amin(dim=(2, 3))).all() and (hv[..., 0] > xv.amin(dim=(2, 3)) * 1.01 - 1e-6).all()
    assert (kcs.amax(-1) >= 250).all() and (vcm.amax((-2, -1)) >= 250).all()  # the 8-bit range is used
    dk, dv = dequantize_blocks(qb, "int4")
    assert torch.equal(dk, (qk - 7.5) * sk[:, :, None])
    assert torch.equal(dv, (qv * sv[..., None] + mv[..., None]).view(N, H, BS, D))


def test_int4_covers_hard_groups():
    """Constant channels, a huge outlier, all-negative and large-offset blocks: no group is clamped."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(4, BS, 2, D, generator=g)
    k[0, :, :, 5] = 3.0  # constant channel
    k[1, 2, 0, 9] = -300.0  # one huge outlier
    k[2] = -k[2].abs() - 50.0  # all negative, far from zero
    k[3] = k[3] * 1e-3 + 1e4  # tiny ranges at a large offset
    qb = quantize_blocks(k, k.clone(), "int4")
    hk, hv, kcs, (vcs, vcm) = int4_parts(qb)
    x = heads_major(k)
    check_int4_keys(x.transpose(2, 3), unpack(qb.k).transpose(2, 3), hk[:, :, None], kcs)
    check_int4_groups(x.reshape(4, 2, BS, D // 32, 32), unpack(qb.v).view(4, 2, BS, D // 32, 32),
                      hv[:, :, None, None], vcs, vcm)


def test_int4_v_header_found_from_v_data_offset():
    # load_int4_tile finds V's header in the K records at 2 * v_data_offset (it knows no kv_heads or
    # block_size): that must be k_scale_offset for every int4 layout
    for heads in (1, 3, 8):
        for D in (32, 64, 96, 128, 256):
            for bs in (8, 16, 32, 48):
                L = BlockLayout(2, heads, D, bs, "int4")
                assert L.k_scale_offset == 2 * L.v_data_offset and L.v_data_offset == L.data_bytes


def test_int4_low_nibble_is_even_channel():
    k = torch.zeros(1, BS, 1, D)
    k[0, 0, 0, :] = torch.arange(D) % 2 * 2.0 - 1.0  # channel parity 0 -> -1 (code 0), 1 -> +1 (15) at token 0
    k[0, 1, 0, :] = -k[0, 0, 0, :]  # token 1 the opposite
    qb = quantize_blocks(k, k.clone(), "int4")
    assert qb.k[0, 0, 0].tolist() == [0xF0] * (D // 2)
    assert qb.k[0, 0, 1].tolist() == [0x0F] * (D // 2)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_zero_and_tiny_blocks_stay_finite(name):
    k = torch.zeros(2, BS, H, D)
    k[1] = 1e-9
    dk, dv = dequantize_blocks(quantize_blocks(k, k.clone(), name), name)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    # int4 keys are symmetric, (q - 7.5) s, with no zero level: a zero key comes back as s / 2 at the
    # smallest step (2**-25); every other format keeps zero exact
    assert dk[0].abs().max() == (2.0 ** -25 if name == "int4" else 0) and dv[0].abs().max() == 0
    assert (dk[1] - 1e-9).abs().max() < 1e-7


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_pages_round_trip_through_layer_views(name):
    k, v = fresh()
    layout = BlockLayout(3, H, D, BS, name)
    cache = KVCache(layout, 9, 1, torch.float32)
    cache.pool.random_(0, 256)  # garbage everywhere else must not leak in
    ids = torch.tensor([8, 0, 3, 5, 1])
    qb = quantize_blocks(k, v, name)
    before = cache.pool.clone()
    store_blocks(cache.layer_view(2), ids, qb)
    dk, dv = dequantize_layer(cache.layer_view(2), ids, name)
    wk, wv = dequantize_blocks(qb, name)
    assert torch.equal(dk, wk) and torch.equal(dv, wv)
    # other layers and pages untouched
    lb = layout.layer_bytes
    assert torch.equal(cache.pool.view(9, 3, lb)[:, :2], before.view(9, 3, lb)[:, :2])
    others = [i for i in range(9) if i not in ids.tolist()]
    assert torch.equal(cache.pool[others], before[others])


def test_bad_dtype_and_shapes_name_the_problem():
    k, v = fresh()
    with pytest.raises(ValueError, match="kv dtype"):
        quantize_blocks(k, v, "fp8")
    with pytest.raises(ValueError, match=r"\[n, bs, KVH, D\]"):
        quantize_blocks(k, v[:, :8], "int8")


@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_bit_decoding_equals_torch_cast_for_every_code(name, dtype):
    from kvmesh.kv.quant import _fp8_bits_to_float
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    want = codes.float()
    got = _fp8_bits_to_float(codes, name)
    finite = torch.isfinite(want)
    assert torch.equal(got[finite], want[finite])
    assert int(finite.sum()) >= 248  # only NaN/inf codes skipped


def test_gathered_layer_equals_strided_view():
    k, v = fresh()
    layout = BlockLayout(2, H, D, BS, "int4")
    cache = KVCache(layout, 7, 1, torch.float32)
    cache.pool.random_(0, 256)
    ids = torch.tensor([6, 2, 2, 0])
    store_blocks(cache.layer_view(1), ids[:1], quantize_blocks(k[:1], v[:1], "int4"))
    strided, gathered = cache.layer_view(1), cache.gather_layer(1, ids)
    for a, b in ((strided.k, gathered.k), (strided.v, gathered.v),
                 (strided.k_scale, gathered.k_scale), (strided.v_scale, gathered.v_scale)):
        assert torch.equal(a[ids].view(torch.uint8), b.contiguous().view(torch.uint8))  # bits: random bytes hold NaNs


def _true_div_scales(x, name, v=None):
    """Reference scales by true float32 division in numpy, as layout.py specifies (x: [n, bs, H, D]).
    int4: the K records' bytes (headers and codes), bf16 rounding done on the numpy bits."""
    a = heads_major(x).double().numpy().astype("float32")  # [n, H, bs, D]
    f32 = a.dtype.type
    if name.startswith("fp8"):
        fmax = f32({"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}[name])
        s = abs(a).max(axis=(2, 3)).clip(min=f32(1e-6)) / fmax
    elif name == "int8":
        s = abs(a).max(axis=3).clip(min=f32(1e-6)) / f32(127.0)
    else:
        return torch.from_numpy(_int4_record_np(a, heads_major(v).double().numpy().astype("float32")))
    return torch.from_numpy(s.astype("float32"))


def _int4_record_np(a, b):
    """numpy float32 K, V [n, H, bs, D] -> uint8 K records [n, H, 16 + D] (layout.py's formulas)."""
    import numpy as np
    f32 = np.float32
    one = f32(1)

    def bf16(x, up):
        b = np.ascontiguousarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
        away = np.ones_like(b) if up else (b < 0).astype(np.int64)
        return (((b + away * 0xFFFF) & -65536).astype(np.int32)).view(np.float32)

    def header(*fields):
        return (np.stack(fields, -1).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bf16 bits

    def value_header(lo, hi):  # [n, H, groups]
        mb = bf16(lo.min(-1), up=False)
        ms = bf16(np.maximum((lo.max(-1) - mb) / f32(255), f32(2.0 ** -24)), up=True)
        cm = np.minimum(np.floor((lo - mb[..., None]) * (one / ms)[..., None]), 255).astype(f32)
        cm -= (cm * ms[..., None] + mb[..., None] > lo)
        span = hi - (cm * ms[..., None] + mb[..., None])
        ss = bf16(np.maximum(span.max(-1) / f32(3825), f32(2.0 ** -24)), up=True)
        return header(mb, ms, ss, np.zeros_like(mb))

    n, H, bs, D = a.shape
    amax = abs(a).max(2)  # [n, H, D]: keys are symmetric per channel
    ss = bf16(np.maximum(amax.max(-1) / f32(1912.5), f32(2.0 ** -24)), up=True)
    kcs = np.clip(np.ceil(amax * (one / (ss * f32(7.5)))[..., None]), 1, 255).astype(np.uint8)
    zero = np.zeros_like(ss)
    g = b.reshape(n, H, bs, D // 32, 32)
    vh = value_header(g.min(-1).reshape(n, H, -1), g.max(-1).reshape(n, H, -1))
    c = np.arange(D)  # the record stores each eight channels as 0 1 4 5 2 3 6 7 (kv/layout.py)
    slots = (c & ~6) | ((c & 2) << 1) | ((c & 4) >> 1)
    return np.concatenate((header(zero, zero, ss, zero), vh, kcs[..., slots]), -1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_scales_are_true_divisions_on_every_device(name, device):
    """A Python-float divisor makes CUDA multiply by the reciprocal (different last bits, different
    pages than the CPU and the Triton kernels); scales must be exact true divisions everywhere."""
    k, v = fresh()
    qb = quantize_blocks(k.to(device), v.to(device), name)
    ref = _true_div_scales(k, name, v)
    if name == "int4":  # every byte of the K records (both headers, K s codes)
        assert torch.equal(qb.k_scale.cpu(), ref)
        return
    got = qb.k_scale.float().cpu()
    sd = qb.k_scale.dtype
    want = ref.to(sd).float()
    if sd == torch.float16:
        want = want.clamp(min=2.0 ** -24)  # the fp16 scale floor (quant.FP16_TINY)
    assert torch.equal(got, want)
    if device == "cuda":  # and the whole page equals the CPU's, bit for bit
        cpu = quantize_blocks(k, v, name)
        for a, b in ((qb.k, cpu.k), (qb.v, cpu.v), (qb.k_scale, cpu.k_scale), (qb.v_scale, cpu.v_scale)):
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
