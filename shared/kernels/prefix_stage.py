"""Stages a step's long-chunk prefixes: one layer's full pages, dequantized once into an fp16 workspace.

The prefill kernel gives each tile of 128 rows (tokens x the G query heads of a KV head) the whole
prefix: read in place, a page is fetched and dequantized once per tile, 64 times for a 2,048-token
chunk at G = 4. That conversion work sits between the loads and the MMAs, so the kernel ran at
0.57-0.67x of the fp16 one. Staged, each page is dequantized once per layer (a memory-bound pass
over the pages, a few microseconds) and the tiles read plain fp16 pages. bf16 pages are staged as
fp16 too: P then multiplies V in fp16, one MMA, where bf16 needs a hi + lo pair for 1e-3 accuracy.
K and V are assumed to lie in fp16's range, as the dequantizing path already does.

Workspace page = one layer of an fp16 block: [K [KVH, BS, D] | V [KVH, BS, D]] fp16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels.backend import PrefixStage
from kvmesh.kernels.formats import FMT_CODES
from kvmesh.kernels.paged_attention import _load_page_tile, _unit
from kvmesh.kv.pool import KVCache


@triton.jit
def stage_pages_kernel(
    pool_ptr,  # uint8 [num_pages, page_bytes]
    src_ptr,  # int32 [P] pool page of each workspace page
    out_ptr,  # fp16 [P, 2, KVH, BS, D]
    page_stride, layer_off,  # in the pool's units (`paged_attention._unit`)
    V_OFF: tl.constexpr, KS_OFF: tl.constexpr, VS_OFF: tl.constexpr, FMT: tl.constexpr,
    KVH: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
):
    i = tl.program_id(0)  # workspace page
    head = tl.program_id(1)
    tok = tl.arange(0, BS)
    ok = tok < BS
    base = tl.load(src_ptr + i).to(tl.int64) * page_stride + layer_off + tl.zeros((BS,), tl.int64)
    d = tl.arange(0, D)
    dst = out_ptr + i.to(tl.int64) * (2 * KVH * BS * D) + ((head * BS + tok) * D)[:, None] + d[None, :]
    # the loader's tile in fp32 (int4's q * s + m too: in place it is packed half2 math) times its
    # per-token scale (fp8 page scale, int8 token scale; 1.0 otherwise), rounded once to fp16
    k, ks = _load_page_tile(pool_ptr, base, tok, ok, head, 0, KS_OFF, True, FMT, BS, D, tl.float32, False)
    tl.store(dst, (k.to(tl.float32) * ks[:, None]).to(tl.float16))
    v, vs = _load_page_tile(pool_ptr, base, tok, ok, head, V_OFF, VS_OFF, False, FMT, BS, D, tl.float32, False)
    tl.store(dst + KVH * BS * D, (v.to(tl.float32) * vs[:, None]).to(tl.float16))


def stage_prefix(cache: KVCache, layer: int, stage: PrefixStage) -> torch.Tensor:
    """Workspace fp16 [P, 2, KVH, BS, D]: layer `layer` of the pages `stage.src_pages`, dequantized."""
    L = cache.layout
    fmt = FMT_CODES[L.kv_dtype]
    unit = _unit(fmt)
    P = int(stage.src_pages.shape[0])
    out = torch.empty(P, 2, L.kv_heads, L.block_size, L.head_dim, dtype=torch.float16, device=cache.pool.device)
    if P:
        stage_pages_kernel[(P, L.kv_heads)](
            cache.pool, stage.src_pages, out, L.block_bytes // unit, layer * L.layer_bytes // unit,
            V_OFF=L.v_data_offset // unit, KS_OFF=L.k_scale_offset, VS_OFF=L.v_scale_offset, FMT=fmt,
            KVH=L.kv_heads, BS=L.block_size, D=L.head_dim, num_warps=4)
    return out
