"""Paged decode attention (one new token per sequence) over the quantized KV pool.

One program per (sequence, KV head, split) serves the G query heads of that KV head (padded to 16
rows for tl.dot), so every page is read once. Its split of the sequence's full pages is read
BLOCK_N tokens at a time through the block table and dequantized in registers (`_load_page_tile`);
the last split also takes the residual tail and the new token. With more than one split each
program writes a normalized partial + log2-sum-exp and `reduce_splits_kernel` combines them.

Decode is memory-bound, so what matters is bytes in flight and whole waves:
- K tiles are loaded without a mask (tokens past the split read pages of the table's first entry or
  page 0, always finite pool memory, and their scores are masked), so loads pipeline freely;
  V tiles and V scales keep the mask (0 * garbage must not reach the accumulator).
- The split count comes from shapes only (no host sync, fixed grid) and the compiled variant's
  residency: whole waves (a last wave 1/3 full cost a third of the time at 64 x 4096).
- Per-format tiles (`TILES`) come from benchmarks/decode_sweep.py on the H200.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kernels.formats import (FMT_BF16, FMT_CODES, FMT_E4M3, FMT_E5M2, FMT_FP16, FMT_FP32,
                                    FMT_INT4, FMT_INT8)
from kvmesh.kernels.paged_attention import (LOG2E, _cast_out, _check, _dot_dtype, _load_page_tile,
                                            _softmax_step, _unit, reduce_splits_kernel)
from kvmesh.kv.pool import KVCache

NUM_SMS_DEFAULT = 132  # H200; the real count is read from the device when there is one
RESIDENT_DEFAULT = 4  # programs per SM assumed where the compiled kernel cannot be inspected
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism
PROGRAM_COST_TOKENS = 128  # a program's fixed cost (prologue, tail, partial write) in tokens read
MAX_SPLITS = 64
REGS_PER_SM = 65536


@dataclass(frozen=True)
class DecodeTiles:
    """Launch choices of the decode kernel for one KV format."""

    block_n: int  # tokens per tile (a multiple of the block size)
    num_stages: int  # Triton pipeline depth: 5 gives two buffers of K/V tiles, 3 one, 1 none
    native_cvt: bool = False  # hardware fp8 -> fp16 conversion instead of bit operations


# Fastest on the H200 over 64 x 4096 and 16 x 16384 (benchmarks/decode_sweep.py, docs/kernels.md).
TILES = {FMT_FP32: DecodeTiles(32, 3), FMT_FP16: DecodeTiles(32, 5), FMT_BF16: DecodeTiles(128, 3),
         FMT_E4M3: DecodeTiles(128, 1, native_cvt=True), FMT_E5M2: DecodeTiles(128, 1),
         FMT_INT8: DecodeTiles(128, 3), FMT_INT4: DecodeTiles(32, 5)}


@triton.jit(do_not_specialize=["num_splits"])  # one compile for every split count
def decode_kernel(
    q_ptr,  # [B, H, D] new queries
    k_ptr,  # [B, KVH, D] new keys (full precision)
    v_ptr,  # [B, KVH, D] new values
    out_ptr,  # [B, H, D] output (PARTIAL == False)
    part_out_ptr,  # fp32 [B, H, splits, D] normalized partial outputs (PARTIAL)
    part_lse_ptr,  # fp32 [B, H, splits] log2-sum-exp of each partial (PARTIAL)
    pool_ptr,  # uint8 [num_pages, page_bytes]
    res_ptr,  # [num_slots, layers, 2, KVH, BS, D] residual tails
    prefix_lens_ptr,  # int32 [B]
    block_tables_ptr,  # int32 [B, max_pages]
    residual_slots_ptr,  # int32 [B]
    stride_qb, stride_qh, stride_kb, stride_vb, stride_ob, stride_oh, stride_bt,
    page_stride,  # units (see paged_attention._unit) between pages
    layer_off,  # layer * layer_bytes, in units
    slot_stride, res_layer_off,  # residual elements between slots; layer offset inside a slot
    qk_scale,  # softmax scale * log2(e)
    num_splits,  # programs per (sequence, KV head) along the pages
    V_OFF: tl.constexpr, KS_OFF: tl.constexpr, VS_OFF: tl.constexpr,
    FMT: tl.constexpr, HAS_SCALE: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
    BS: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PARTIAL: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    prefix = tl.load(prefix_lens_ptr + b)
    r = tl.arange(0, BLOCK_H)
    head = kvh * G + r  # [M] query heads of this KV head (rows >= G are padding)
    row_ok = r < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (head * stride_qh)[:, None] + d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT)  # [M, D]
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    m_i = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)

    # 1. this split's full pages, in whole tiles (per_split is a multiple of the tile's pages)
    PAGES: tl.constexpr = BLOCK_N // BS
    n_pages = prefix // BS
    per_split = tl.cdiv(tl.cdiv(n_pages, num_splits), PAGES) * PAGES
    p_lo = split * per_split
    n_end = tl.minimum(n_pages, p_lo + per_split) * BS
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    all_rows = tl.full((BLOCK_N,), 1, tl.int1)
    for n0 in range(p_lo * BS, n_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < n_end
        page = tl.load(bt_row + n // BS, mask=nm, other=0).to(tl.int64)
        base = page * page_stride + layer_off  # [N] offset of the page's layer (in units)
        tok = n % BS
        kt, ks = _load_page_tile(pool_ptr, base, tok, all_rows, kvh, 0, KS_OFF, True, FMT, BS, D, DOT,
                                 NATIVE)
        vt, vs = _load_page_tile(pool_ptr, base, tok, nm, kvh, V_OFF, VS_OFF, False, FMT, BS, D, DOT,
                                 NATIVE)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kt, ks, vt, vs, nm[None, :], qk_scale,
                                      HAS_SCALE, DOT)

    if split == num_splits - 1:
        # 2. residual tail (prefix % BS tokens, full precision) and 3. the new token
        t = tl.arange(0, BS)
        n_tail = prefix % BS
        tm = t < n_tail
        is_new = (t == n_tail)[:, None]  # the new token joins the tail tile as row n_tail (< BS)
        valid = (t <= n_tail)[None, :]
        slot = tl.load(residual_slots_ptr + b).to(tl.int64)
        rk = res_ptr + slot * slot_stride + res_layer_off + ((kvh * BS + t) * D)[:, None]
        rv = rk + KVH * BS * D
        kn = k_ptr + b.to(tl.int64) * stride_kb + kvh * D
        vn = v_ptr + b.to(tl.int64) * stride_vb + kvh * D
        kt = tl.where(is_new, tl.load(kn + d)[None, :], tl.load(rk + d[None, :], mask=tm[:, None], other=0.0))
        vt = tl.where(is_new, tl.load(vn + d)[None, :], tl.load(rv + d[None, :], mask=tm[:, None], other=0.0))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kt.to(DOT), kt, vt.to(DOT), vt, valid, qk_scale,
                                      False, DOT)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if PARTIAL:
        ph = b.to(tl.int64) * (KVH * G) + head  # [M] row of [B, H]
        tl.store(part_out_ptr + ((ph * num_splits + split) * D)[:, None] + d[None, :], o,
                 mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + ph * num_splits + split, lse, mask=row_ok)
    else:
        op = out_ptr + b.to(tl.int64) * stride_ob + (head * stride_oh)[:, None] + d[None, :]
        tl.store(op, _cast_out(o, out_ptr.dtype.element_ty), mask=row_ok[:, None])


def num_splits(batch: int, kv_heads: int, max_context: int, num_sms: int,
               resident_per_sm: int = RESIDENT_DEFAULT, block_n: int = 64) -> int:
    """Splits per (sequence, KV head), from shapes only. Programs move equal bytes, so the time is
    waves (programs / programs resident at once, rounded up) x one program's time (its tokens plus a
    fixed cost worth PROGRAM_COST_TOKENS): e.g. 16 x 8 programs on 132 SMs x 4 want 4 splits (one
    full wave), not 5 (a second wave 20 % full); 64 x 8 want none."""
    base = batch * kv_heads
    capacity = max(1, num_sms * resident_per_sm)
    cap = max(1, min(MAX_SPLITS, max_context // max(MIN_TOKENS_PER_SPLIT, block_n)))

    def cost(s: int) -> float:
        return -(-base * s // capacity) * (max_context / s + PROGRAM_COST_TOKENS)
    return min(range(1, cap + 1), key=lambda s: (cost(s), s))


def resident_programs(n_regs: int, shared: int, num_warps: int, smem_per_sm: int) -> int:
    """Programs of a compiled kernel that fit on one SM at once (registers are allocated per warp in
    units of 256, each program reserves 1 KB of shared memory beside its own)."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = REGS_PER_SM // max(1, regs_per_warp * num_warps)
    by_smem = smem_per_sm // (shared + 1024)
    by_threads = 2048 // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


class _Residency:
    """Programs per SM of each compiled decode variant, read once from its registers and shared
    memory (a variant is compiled before its first launch anyway)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, int] = {}

    def get(self, key: tuple, device: torch.device, compile_variant) -> int:
        if key not in self._by_key:
            n = RESIDENT_DEFAULT
            if device.type == "cuda":
                try:
                    kernel = compile_variant()
                    kernel._init_handles()
                    props = torch.cuda.get_device_properties(device)
                    n = resident_programs(kernel.n_regs, kernel.metadata.shared, kernel.metadata.num_warps,
                                          props.shared_memory_per_multiprocessor)
                except Exception as e:  # an unknown Triton version: keep the default, say so once
                    logging.getLogger(__name__).warning("decode residency probe failed (%s: %s); assuming %d "
                                                        "programs per SM", type(e).__name__, e, n)
            self._by_key[key] = n
        return self._by_key[key]


_RESIDENCY = _Residency()


def decode_attention(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata, scale: float, *, splits: int | None = None,
                     block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                     programs_per_sm: int = 0, native_cvt: bool | None = None,
                     block_h: int | None = None, maxnreg: int | None = None) -> torch.Tensor:
    """out [B, H, D] for q [B, H, D] (one new token per sequence, k/v [B, KVH, D] its new K/V).
    The keyword arguments override the defaults (benchmarks, tests): `native_cvt` converts fp8/int8
    with the hardware instructions instead of bit operations; `programs_per_sm` replaces the
    residency read from the compiled kernel in the split count; `block_h` sets the query rows of a
    program (default G padded to 16; Triton also pads smaller dots itself); `maxnreg` caps
    registers per thread."""
    if meta.max_query_len != 1 or q.shape[0] != meta.num_seqs:
        raise ValueError(f"decode needs one new token per sequence: max_query_len={meta.max_query_len}, "
                         f"T={q.shape[0]}, B={meta.num_seqs}")
    _check(cache, layer, q, k, v, meta)
    L = cache.layout
    B, H, D = q.shape
    G = H // L.kv_heads
    fmt = FMT_CODES[L.kv_dtype]
    tiles = TILES[fmt]
    block_n = block_n or max(tiles.block_n, L.block_size)
    if block_h is not None and block_h < G:
        raise ValueError(f"block_h must be at least the {G} query heads per KV head, got {block_h}")
    if block_n % L.block_size:
        raise ValueError(f"block_n must be a multiple of the block size {L.block_size}, got {block_n}")
    num_stages = tiles.num_stages if num_stages is None else num_stages
    native_cvt = tiles.native_cvt if native_cvt is None else native_cvt
    unit = _unit(fmt)
    out = torch.empty_like(q)
    res = cache.residual
    args = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, out_ptr=out, pool_ptr=cache.pool, res_ptr=res,
        prefix_lens_ptr=meta.prefix_lens, block_tables_ptr=meta.block_tables,
        residual_slots_ptr=meta.residual_slots,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_kb=k.stride(0), stride_vb=v.stride(0),
        stride_ob=out.stride(0), stride_oh=out.stride(1), stride_bt=meta.block_tables.stride(0),
        page_stride=L.block_bytes // unit, layer_off=layer * L.layer_bytes // unit,
        slot_stride=res.stride(0), res_layer_off=layer * res.stride(1), qk_scale=scale * LOG2E,
        V_OFF=L.v_data_offset // unit, KS_OFF=L.k_scale_offset, VS_OFF=L.v_scale_offset,
        FMT=fmt, HAS_SCALE=fmt in (FMT_E4M3, FMT_E5M2, FMT_INT8), KVH=L.kv_heads, G=G,
        BS=L.block_size, D=D, BLOCK_H=block_h or max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
        DOT=_dot_dtype(fmt, q), NATIVE=native_cvt,
        num_warps=num_warps, num_stages=num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg}))
    if splits is None:
        if programs_per_sm:
            resident = programs_per_sm
        else:  # the partial-writing variant is the one that runs whenever splitting pays
            key = tuple(v for n, v in args.items() if n.isupper() or n.startswith(("num_", "max"))) + (
                q.dtype, q.device)
            one = torch.empty(1, dtype=torch.float32, device=q.device)  # warmup wraps only positional dtypes
            resident = _RESIDENCY.get(key, q.device, lambda: decode_kernel.warmup(
                **args, part_out_ptr=one, part_lse_ptr=one, num_splits=2, PARTIAL=True, grid=(1,)))
        splits = num_splits(B, L.kv_heads, meta.max_prefix_len + 1, _num_sms(q.device), resident, block_n)
    if splits > 1:
        part_out = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    decode_kernel[(B, L.kv_heads, splits)](**args, part_out_ptr=part_out, part_lse_ptr=part_lse,
                                           num_splits=splits, PARTIAL=splits > 1)
    if splits > 1:
        reduce_splits_kernel[(B, H)](
            part_out_ptr=part_out, part_lse_ptr=part_lse, out_ptr=out,
            stride_ot=out.stride(0), stride_oh=out.stride(1),
            H=H, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), D=D, num_warps=4)
    return out
