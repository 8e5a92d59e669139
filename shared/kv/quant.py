"""Torch reference of the KV quantization math written down in `layout.py`.

Write path: `quantize_blocks` turns whole blocks of K/V rows into stored parts (data + scales) and
`store_blocks` puts them into a layer's typed page views. Read path: `dequantize_layer` turns pages
back into float K/V. Every function works on a batch of blocks at once (no loops over tokens), on
any device. Scales are rounded to their stored dtype *before* quantizing, so dequantization uses
exactly what is stored; the Triton kernels follow the same math.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.kv.layout import INT4_GROUP, INT4_HEADER, INT4_K_OFFSET, KVFormat
from kvmesh.kv.pool import SCALE_DTYPES, STORAGE_DTYPES, LayerView

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
INT8_MAX = 127.0
INT4_LEVELS = 15.0
INT4_CODES = 255.0  # 8-bit scale codes
INT4_STEP_FLOOR = 2.0 ** -24  # smallest m_step / s_step: a constant group never divides by zero
SCALE_FLOOR = 1e-6
FP16_TINY = 2.0 ** -24  # smallest fp16 subnormal: an fp16 scale never rounds to zero (no 0/0)


@dataclass
class QuantizedBlocks:
    """Stored parts of n whole blocks of one layer, shaped like `LayerView` with n leading."""

    k: torch.Tensor  # [n, KVH, bs, D] storage dtype (int4: uint8 [n, KVH, bs, D // 2])
    v: torch.Tensor  # same
    k_scale: torch.Tensor | None  # format-specific (see layout.py), leading dim n
    v_scale: torch.Tensor | None


def _fmt_name(fmt: str | KVFormat) -> str:
    name = fmt.name if isinstance(fmt, KVFormat) else fmt
    if name not in STORAGE_DTYPES:
        raise ValueError(f"kv dtype must be canonical ({', '.join(STORAGE_DTYPES)}), got {name!r}")
    return name


def _round_scale(s: torch.Tensor, name: str) -> torch.Tensor:
    """Round a float32 scale to its stored dtype and back (what dequantization will see)."""
    sd = SCALE_DTYPES[name]
    if sd == torch.float16:
        s = s.clamp(max=65504.0).to(torch.float16).float()
        return s.clamp(min=FP16_TINY)
    return s.to(sd).float()


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [..., D] integer values 0..15 -> uint8 [..., D // 2], low nibble = even channel."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D // 2] -> float32 [..., D] values 0..15."""
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2).float()  # interleave on bytes, cast once


def _divisor(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor on `like`'s device. Dividing by a Python float (or a CPU scalar) makes CUDA
    multiply by its reciprocal, which rounds differently from layout.py's true division (and from
    the CPU and the Triton kernels); a device tensor divisor keeps the division true everywhere."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def _quantize_one(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: float32 [n, KVH, bs, D] -> (data, scale) in the stored dtypes."""
    n, H, bs, D = x.shape
    if name in ("fp32", "fp16", "bf16"):
        return x.to(STORAGE_DTYPES[name]), None
    if name in FP8_MAX:
        fmax = FP8_MAX[name]
        s = _round_scale(x.abs().amax(dim=(2, 3)).clamp(min=SCALE_FLOOR) / _divisor(fmax, x), name)  # [n, H]
        q = (x / s[:, :, None, None]).clamp(-fmax, fmax).to(STORAGE_DTYPES[name])
        return q, s.to(SCALE_DTYPES[name])
    if name == "int8":
        qmax = _divisor(INT8_MAX, x)
        s = _round_scale(x.abs().amax(dim=3).clamp(min=SCALE_FLOOR) / qmax, name)  # [n, H, bs]
        q = torch.round(x / s[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return q, s.to(SCALE_DTYPES[name])
    raise ValueError(f"unsupported kv dtype {name!r}")


def _fp8_bits_to_float(q: torch.Tensor, name: str) -> torch.Tensor:
    """fp8 -> float32 by moving the bits into an fp16 (exact; the CPU's own fp8 cast is scalar and
    slow). e5m2 is the top byte of an fp16. e4m3's sign/exponent/mantissa shifted into fp16's is the
    value / 256 for normals and subnormals alike (bias 7 vs 15); NaN never occurs (we clamp)."""
    b = q.view(torch.uint8).to(torch.int16)
    if name == "fp8_e5m2":
        return (b << 8).view(torch.float16).float()
    # sign bit 7 -> 15: adding it once carries bit 14 into 15 after the shift (int16 wraps)
    return ((b + (b & 0x80)) << 7).view(torch.float16).float().mul_(256.0)


def _bf16_round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """fp32 -> the nearest bf16 value toward +inf (up, x >= 0) or toward -inf (down), as fp32: integer
    ops on the bits (round the magnitude up for up / negative down, else truncate)."""
    b = x.contiguous().view(torch.int32)
    away = torch.full_like(b, 1) if up else (b < 0).to(torch.int32)  # 1: magnitude rounds up
    return ((b + away * 0xFFFF) & -65536).view(torch.float32)


def _int4_code_slots(d: int, device) -> torch.Tensor:
    """Record position -> channel of the K s codes (kv/layout.py: channels 2-3 and 4-5 of each
    eight swap places; the permutation is its own inverse)."""
    c = torch.arange(d, device=device)
    return (c & -8) | (c & 1) | ((c & 2) << 1) | ((c & 4) >> 1)


def int4_key_codes(rec: torch.Tensor) -> torch.Tensor:
    """K records [..., 16 + D] -> their s codes [..., D] in channel order."""
    slots = _int4_code_slots(rec.shape[-1] - INT4_HEADER, rec.device)  # the swap is its own inverse
    return rec[..., INT4_HEADER:][..., slots]


def _int4_key_group_codes(a: torch.Tensor):
    """Channel absmax [n, H, D] -> (K header u8 [n, H, 8], s codes u8 [n, H, D], 1 / s float32):
    layout.py's symmetric keys, every rounding before use."""
    one = _divisor(1.0, a)
    s_step = _bf16_round((a.amax(dim=2) / _divisor(INT4_K_OFFSET * INT4_CODES, a)).clamp(min=INT4_STEP_FLOOR),
                         up=True)  # [n, H]
    cs = torch.ceil(a * (one / (s_step * INT4_K_OFFSET))[..., None]).clamp(1, INT4_CODES)
    inv = one / (cs * s_step[..., None])
    zero = torch.zeros_like(s_step)
    header = torch.stack((zero, zero, s_step, zero), dim=2).to(torch.bfloat16)
    return header.view(torch.uint8), cs.to(torch.uint8), inv


def _int4_group_codes(lo: torch.Tensor, hi: torch.Tensor):
    """Value group minima/maxima [n, H, groups] -> (header u8 [n, H, 8], s codes, m codes u8 [n, H,
    groups], 1 / s, m float32 [n, H, groups]): layout.py's double quantization, every rounding before use."""
    one = _divisor(1.0, lo)
    m_base = _bf16_round(lo.amin(dim=2), up=False)  # [n, H]
    m_step = _bf16_round(((lo.amax(dim=2) - m_base) / _divisor(INT4_CODES, lo)).clamp(min=INT4_STEP_FLOOR), up=True)
    cm = torch.floor((lo - m_base[..., None]) * (one / m_step)[..., None]).clamp(max=INT4_CODES)  # >= 0
    cm -= (cm * m_step[..., None] + m_base[..., None] > lo).float()  # reciprocal rounded up: keep m <= lo
    m = cm * m_step[..., None] + m_base[..., None]  # code * step is exact: an FMA rounds the same
    span = hi - m
    s_step = _bf16_round((span.amax(dim=2) / _divisor(INT4_LEVELS * INT4_CODES, lo)).clamp(min=INT4_STEP_FLOOR),
                         up=True)
    cs = torch.ceil(span * (one / (s_step * INT4_LEVELS))[..., None]).clamp(1, INT4_CODES)
    inv = one / (cs * s_step[..., None])  # the data divide by multiplying with 1 / s (one per group)
    header = torch.stack((m_base, m_step, s_step, torch.zeros_like(m_base)), dim=2).to(torch.bfloat16)
    return header.view(torch.uint8), cs.to(torch.uint8), cm.to(torch.uint8), inv, m


def _quantize_int4(kx: torch.Tensor, vx: torch.Tensor) -> QuantizedBlocks:
    """kx, vx float32 [n, H, bs, D] -> packed nibbles, K records [n, H, 16 + D] (K header, V header,
    s codes) and V codes [n, H, bs, 2, G] (layout.py)."""
    n, H, bs, D = kx.shape
    kh, kcs, kinv = _int4_key_group_codes(kx.abs().amax(dim=2))  # groups [n, H, D]
    kq = torch.round(kx * kinv[:, :, None, :] + INT4_K_OFFSET).clamp(0, INT4_LEVELS)  # two roundings, as layout.py
    g = vx.view(n, H, bs, D // INT4_GROUP, INT4_GROUP)
    vh, vcs, vcm, vinv, vm = _int4_group_codes(g.amin(dim=4).view(n, H, -1), g.amax(dim=4).view(n, H, -1))
    vinv, vm = vinv.view(n, H, bs, -1, 1), vm.view(n, H, bs, -1, 1)
    vq = torch.round((g - vm) * vinv).clamp(0, INT4_LEVELS).view(n, H, bs, D)
    k_rec = torch.cat((kh, vh, kcs[..., _int4_code_slots(D, kcs.device)]), dim=2)
    v_codes = torch.stack((vcs.view(n, H, bs, -1), vcm.view(n, H, bs, -1)), dim=3)  # [n, H, bs, 2, G]
    return QuantizedBlocks(_pack_int4(kq), _pack_int4(vq), k_rec, v_codes)


def _int4_header(rec: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Header bytes at `at` of K records [n, H, bytes] -> m_base, m_step, s_step float32 [n, H, 1]."""
    h = rec[..., at:at + 8].contiguous().view(torch.bfloat16).float()  # [n, H, 4]
    return h[..., 0:1], h[..., 1:2], h[..., 2:3]


def _int4_scales(rec: torch.Tensor, at: int, cs: torch.Tensor, cm: torch.Tensor):
    """Codes [n, H, ...] and their header at byte `at` of K records -> s, m float32 [n, H, ...]."""
    m_base, m_step, s_step = _int4_header(rec, at)
    shape = m_base.shape + (1,) * (cs.dim() - 3)  # broadcast over the codes' trailing dims
    s = cs.float() * s_step.view(shape)
    m = cm.float() * m_step.view(shape) + m_base.view(shape)
    return s, m


def quantize_blocks(k: torch.Tensor, v: torch.Tensor, fmt: str | KVFormat) -> QuantizedBlocks:
    """Quantize whole blocks. k, v: [n, bs, KVH, D] (rows in token order) in any float dtype."""
    name = _fmt_name(fmt)
    if k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"k and v must both be [n, bs, KVH, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if name == "int4" and k.shape[-1] % INT4_GROUP:
        raise ValueError(f"int4 KV needs head_dim divisible by {INT4_GROUP}, got {k.shape[-1]}")
    kx = k.float().transpose(1, 2).contiguous()  # [n, KVH, bs, D]
    vx = v.float().transpose(1, 2).contiguous()
    if name == "int4":
        return _quantize_int4(kx, vx)
    kq, ks = _quantize_one(kx, name)
    vq, vs = _quantize_one(vx, name)
    return QuantizedBlocks(kq, vq, ks, vs)


def store_blocks(view: LayerView, block_ids: torch.Tensor, qb: QuantizedBlocks) -> None:
    """Write quantized blocks into pages `block_ids` (int64 [n], all valid) of one layer's view."""
    view.k[block_ids] = qb.k
    view.v[block_ids] = qb.v
    if view.k_scale is not None:
        view.k_scale[block_ids] = qb.k_scale
        view.v_scale[block_ids] = qb.v_scale


def dequantize(kq: torch.Tensor, vq: torch.Tensor, ks: torch.Tensor | None, vs: torch.Tensor | None,
               fmt: str | KVFormat, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored parts of n blocks -> k, v [n, KVH, bs, D] in `dtype` (math in float32)."""
    name = _fmt_name(fmt)
    if name in ("fp32", "fp16", "bf16"):
        return kq.to(dtype), vq.to(dtype)
    # in-place ops after the one cast: dequantization is memory bound on the CPU
    if name in FP8_MAX:
        k = _fp8_bits_to_float(kq, name).mul_(ks.float()[:, :, None, None])
        v = _fp8_bits_to_float(vq, name).mul_(vs.float()[:, :, None, None])
    elif name == "int8":
        k = kq.float().mul_(ks.float()[..., None])
        v = vq.float().mul_(vs.float()[..., None])
    else:  # int4: keys (q - 7.5) s, values q s + m; codes -> (s, m) per group first (small)
        D = kq.shape[-1] * 2
        s = int4_key_codes(ks).float() * _int4_header(ks, 0)[2]  # [n, H, D]
        k = _unpack_int4(kq).sub_(INT4_K_OFFSET).mul_(s[:, :, None, :])  # (q - 7.5) s: exact in fp32
        s, m = _int4_scales(ks, 8, vs[:, :, :, 0], vs[:, :, :, 1])  # [n, H, bs, G]
        n, H, bs = vs.shape[:3]
        g = _unpack_int4(vq).view(n, H, bs, D // INT4_GROUP, INT4_GROUP)
        v = g.mul_(s[..., None]).add_(m[..., None]).view(n, H, bs, D)
    return k.to(dtype), v.to(dtype)


def dequantize_blocks(qb: QuantizedBlocks, fmt: str | KVFormat,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """`QuantizedBlocks` -> k, v [n, KVH, bs, D]."""
    return dequantize(qb.k, qb.v, qb.k_scale, qb.v_scale, fmt, dtype)


def dequantize_layer(view: LayerView, block_ids: torch.Tensor, fmt: str | KVFormat,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages `block_ids` (int64 [n]) of one layer -> k, v [n, KVH, bs, D] in `dtype`."""
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, block_ids)  # faster than t[ids] on strided pages

    return dequantize(pick(view.k), pick(view.v), pick(view.k_scale), pick(view.v_scale), fmt, dtype)
