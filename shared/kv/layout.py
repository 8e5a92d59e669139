"""The byte layout of one KV block, and the memory arithmetic built on it.

A block holds `block_size` tokens of K and V for *every* layer, as one contiguous run of bytes
(data and scales together), so it moves between services as one buffer and lands in a pool with
one copy. Inside a block, layer by layer:

    [ K data | V data | K scales | V scales ]   (each region padded to 16 bytes)

    K/V data:   [kv_heads, block_size, head_dim]          storage dtype (int4: head_dim // 2 bytes,
                                                           low nibble = even channel)
    scales per format (see KVFormat below):
      fp8_e4m3 / fp8_e5m2: K, V  [kv_heads]                float32  x = q * s
      int8:                K, V  [kv_heads, block_size]    float16  x = q * s (symmetric, per token)
      int4:                K     [kv_heads, 16 + head_dim]  uint8, one record per head:
                                   bytes 0..7   K header: bf16 (0, 0, s_step, 0)
                                   bytes 8..15  V header: bf16 (m_base, m_step, s_step, 0)
                                   then K s codes [head_dim] u8, each eight channels in the
                                   order 0 1 4 5 2 3 6 7
                           V     [kv_heads, block_size, 2, head_dim // 32]  uint8 codes per token
                                   and 32-channel group: [.., 0, g] = s code, [.., 1, g] = m code
      auto / fp16 / bf16 / fp32: no scales

Quantization math (the torch reference in `quant.py` and the Triton kernels must agree exactly;
scales are rounded to their stored form *before* quantizing, so dequantization uses what is stored):
    fp8:  s = max(absmax(x[head]), 1e-6) / FMAX  (FMAX 448 e4m3, 57344 e5m2); q = cast(clamp(x / s, ±FMAX))
    int8: s = max(absmax(x[head, token]), 1e-6) / 127; q = clamp(round_half_even(x / s), -127, 127)
    int4: values x = q * s + m, keys x = (q - 7.5) * s (symmetric: the engine centers every key on
          its static per-channel center first, model/key_centers.py). Groups: K = each channel over
          the block's tokens, V = each token's 32-channel group. Each group's scale s (and V's m) is
          an 8-bit code against a per-(block, layer, head, K|V) bf16 header ("double quantization");
          lo, hi = the group's min, max; a = max(|lo|, |hi|); 1/a = RN(1 / a) (IEEE):
          keys:   s_step = up(max(max a / 1912.5, 2**-24))                     (1912.5 = 7.5 * 255)
                  cs     = clamp(ceil(a * 1/(7.5 * s_step)), 1, 255);  s = cs * s_step
                  q      = clamp(round_half_even((x * 1/s) + 7.5), 0, 15)   (two roundings, in this order)
          values: m_base = down(min lo);  m_step = up(max((max lo - m_base) / 255, 2**-24))
                  cm     = min(floor((lo - m_base) * 1/m_step), 255), minus 1 if cm * m_step + m_base > lo
                  m      = cm * m_step + m_base                              (m <= lo, exactly)
                  span   = hi - m;  s_step = up(max(max span / 3825, 2**-24))
                  cs     = clamp(ceil(span * 1/(15 * s_step)), 1, 255);  s = cs * s_step
                  q      = clamp(round_half_even((x - m) * 1/s), 0, 15)    (never clamps: 0 <= y <= 15.0000036)
          down/up round an fp32 to bf16 (8 significant bits) toward -inf/+inf by integer ops on its
          bits: the header is exact in bf16 and code * step is exact in fp32 (an FMA gives the same
          m). Divisions by a group's scale are multiplies by one reciprocal per group (cheap in the
          kernel, bit-identical in torch); the kernel must not fuse a product into the next add.
          The V header sits in the K record (the V loader finds it at 2 * v_data_offset, which is
          k_scale_offset), so both scale regions index by head or row alone.
          Bits per element: K 4 + (16 + head_dim) * 8 / (block_size * head_dim) (4.625 at head_dim
          64, 4.5625 at 128, block 16), V 4 + 0.5: 4.53-4.56 on average (v2, asymmetric keys with
          m codes: 4.78-4.81; v1, fp16 (s, m): 5.5).
float16 scales (int8) are clamped to >= 2**-24 (fp16's smallest subnormal) after rounding, so a
near-zero group never stores s = 0 (int8's 1e-6 / 127 floor would round to 0 in fp16).
The whole block is quantized at once (see kernels/backend.py), so per-block scales are exact.

This module imports no torch: the gateway and `kvmesh memory` use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KVCacheDtype = Literal["auto", "fp16", "bf16", "fp32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp16", "bf16", "fp32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")

INT4_GROUP = 32  # channels per value group in int4 (KIVI-style per-token groups)
INT4_HEADER = 16  # bytes of the K and V bf16 headers at the start of each int4 K record
INT4_K_OFFSET = 7.5  # int4 keys are symmetric: x = (q - 7.5) * s, q in 0..15
_ALIGN = 16  # bytes; regions start on 16-byte boundaries so kernels can use vector loads


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def canonical_kv_dtype(kv_cache_dtype: str, model_dtype: str = "fp16") -> str:
    """Resolve vLLM-style names: `fp8` means e4m3, `auto` means the model's own dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "fp8":
        return "fp8_e4m3"
    if kv_cache_dtype == "auto":
        return model_dtype
    return kv_cache_dtype


@dataclass(frozen=True)
class KVFormat:
    """How one K or V element and its scales are stored, for one canonical KV dtype."""

    name: str
    """Canonical name: fp16, bf16, fp32, fp8_e4m3, fp8_e5m2, int8 or int4."""
    bits: int
    """Bits per stored element."""
    scale_bytes_per_elem: int
    """Bytes of one scale value (0: no scales; int4 counts its scale regions in bytes)."""

    @property
    def quantized(self) -> bool:
        return self.scale_bytes_per_elem > 0

    @staticmethod
    def of(canonical: str) -> "KVFormat":
        # a table built once: the kernels' launchers ask for it per layer and step (it was rebuilt,
        # seven objects a call, ~1,300 times a serving step on a GPU)
        fmt = _FORMATS.get(canonical)
        if fmt is None:
            raise ValueError(f"unknown canonical KV dtype {canonical!r}")
        return fmt

    def k_scale_count(self, kv_heads: int, block_size: int, head_dim: int) -> int:
        """Number of K scale values in one block and layer."""
        if self.name.startswith("fp8"):
            return kv_heads
        if self.name == "int8":
            return kv_heads * block_size
        if self.name == "int4":  # per head: K and V headers, then an s code per channel
            return kv_heads * (INT4_HEADER + head_dim)
        return 0

    def v_scale_count(self, kv_heads: int, block_size: int, head_dim: int) -> int:
        """Number of V scale values in one block and layer."""
        if self.name == "int4":  # (s, m) codes per token and 32-channel group
            return kv_heads * block_size * 2 * (head_dim // INT4_GROUP)
        return self.k_scale_count(kv_heads, block_size, head_dim)


_FORMATS = {f.name: f for f in (KVFormat("fp32", 32, 0), KVFormat("fp16", 16, 0), KVFormat("bf16", 16, 0),
                                KVFormat("fp8_e4m3", 8, 4), KVFormat("fp8_e5m2", 8, 4), KVFormat("int8", 8, 2),
                                KVFormat("int4", 4, 1))}


@dataclass(frozen=True)
class BlockLayout:
    """Byte offsets of every region inside one block. All offsets are in bytes from the block start."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str
    """Canonical KV dtype (see `canonical_kv_dtype`)."""

    def __post_init__(self) -> None:
        fmt = KVFormat.of(self.kv_dtype)
        if self.block_size <= 0 or self.block_size % 8:
            raise ValueError(f"--block-size must be a positive multiple of 8, got {self.block_size}")
        if fmt.name == "int4" and self.head_dim % INT4_GROUP:
            raise ValueError(f"int4 KV needs head_dim divisible by {INT4_GROUP}, got {self.head_dim}")

    @property
    def fmt(self) -> KVFormat:
        return KVFormat.of(self.kv_dtype)

    @property
    def data_bytes(self) -> int:
        """Bytes of K (or V) data for one layer: [kv_heads, block_size, head_dim]."""
        return self.kv_heads * self.block_size * self.head_dim * self.fmt.bits // 8

    @property
    def k_scale_bytes(self) -> int:
        return self.fmt.k_scale_count(self.kv_heads, self.block_size, self.head_dim) * self.fmt.scale_bytes_per_elem

    @property
    def v_scale_bytes(self) -> int:
        return self.fmt.v_scale_count(self.kv_heads, self.block_size, self.head_dim) * self.fmt.scale_bytes_per_elem

    @property
    def k_data_offset(self) -> int:
        return 0

    @property
    def v_data_offset(self) -> int:
        return _align(self.data_bytes)

    @property
    def k_scale_offset(self) -> int:
        return 2 * _align(self.data_bytes)

    @property
    def v_scale_offset(self) -> int:
        return self.k_scale_offset + _align(self.k_scale_bytes)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer inside a block (the stride between layers)."""
        return self.v_scale_offset + _align(self.v_scale_bytes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block: every layer's K, V and scales."""
        return self.num_layers * self.layer_bytes

    @property
    def bytes_per_token(self) -> float:
        """KV bytes per token, data and scales, as stored."""
        return self.block_bytes / self.block_size

    @property
    def data_bytes_per_token(self) -> float:
        return 2 * self.num_layers * self.data_bytes / self.block_size

    @property
    def scale_bytes_per_token(self) -> float:
        return self.bytes_per_token - self.data_bytes_per_token


def tokens_per_gib(layout: BlockLayout) -> float:
    """KV tokens that fit in one GiB of pool memory."""
    return (1 << 30) / layout.bytes_per_token


def sequences_that_fit(layout: BlockLayout, memory_bytes: int, seq_len: int) -> int:
    """Whole sequences of `seq_len` tokens that fit in `memory_bytes` (each rounds up to full blocks)."""
    blocks_per_seq = -(-seq_len // layout.block_size)
    return int(memory_bytes // layout.block_bytes) // blocks_per_seq
