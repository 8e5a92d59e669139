"""Launch choices of the plain decode kernel (`decode_attention.py`) per KV format: its tile, pipeline
depth and grid order, the constexprs they come to, and for bf16 pages which form of p . v a launch takes."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import triton
import triton.language as tl

from kvmesh.kernels.formats import (FMT_BF16, FMT_CODES, FMT_E4M3, FMT_E5M2, FMT_FP16, FMT_FP32, FMT_INT4,
                                    FMT_INT8)
from kvmesh.kernels.paged_attention import _unit
from kvmesh.kernels.splits import num_splits, waves
from kvmesh.kernels.work_list import BatchContexts
from kvmesh.kv.layout import BlockLayout


@dataclass(frozen=True)
class DecodeTiles:
    """Launch choices of the decode kernel for one KV format."""

    block_n: int  # tokens per tile (a multiple of the block size)
    num_stages: int  # Triton pipeline depth: 5 gives two buffers of K/V tiles, 3 one, 1 none
    native_cvt: bool = False  # hardware fp8 -> fp16 conversion instead of bit operations
    split_codes: int = 0  # 8-bit codes as 32-bit words in even/odd channel halves: 1 K and V, 2 V only
    pad_rows: bool = True  # query rows padded to 16 (else G: Triton pads the dot, the softmax runs on G)
    heads_first: bool = False  # grid (KVH, B, splits): a sequence's KV heads launched side by side
    tail_early: bool = False  # the tail's slot id and new K/V row loaded with q (SPLIT 0 only)
    heads_first_past_one_wave: bool = False  # heads first where one split's programs take more than a wave
    maxnreg: int | None = None  # register cap for this tile at head_dim 128 (fp16: 128 keeps 4 programs an SM)
    # bf16 pages: p . v as one dot with p's lo part in the padding query rows where `lo_rows_launch` takes it,
    # at this pipeline depth where the whole launch then fits one wave (0: lo rows never)
    lo_rows_deep_stages: int = 0
    # (tokens a tile, pipeline depth) of a launch taken where it fits one wave (`one_wave_launch`); () never
    one_wave: tuple[int, int] | tuple[()] = ()
    # (tokens a tile, pipeline depth, register cap or 0) of a launch taken where it runs unsplit in more
    # than one wave (`past_one_wave_launch`); () never
    past_one_wave: tuple[int, int, int] | tuple[()] = ()


# Fastest on the H200 over 64 x 4096 and 16 x 16384 (benchmarks/decode_sweep.py, docs/kernels.md).
# bf16 heads first: +1 % at 64 x 4096 and 256 x 1024, = elsewhere (fp16: +0.9 % at 256 x 1024, -0.4-0.6 %
# at two others: not kept). H200, two runs of benchmarks/decode_direct_sweep.py (docs/decode_direct.md).
# fp16/bf16 tail_early: +1.2 / +1.5 % at 256 x 1,024, bf16 +0.8 % at 16 x 16,384 and 8 x 32,768, = elsewhere;
# fp16 heads first past one wave: +0.8-1.2 % at 256 x 1,024 (the only case it changes).
# fp16 one wave at 128 x 5 (one program an SM, 140 KB of shared memory): 16 x 16,384 0.955 -> 0.990x SDPA,
# 8 x 32,768 0.966 -> 0.998x; past one wave it loses (64 x 4,096 0.948x, 256 x 1,024 0.852x against 0.95-0.97x).
# Past one wave, unsplit (256 x 1,024, two runs of decode_direct_sweep.py, twenty-second session): fp16 at
# 64 x 2 0.977-0.980x against the 32 x 5 tile's 0.949-0.952x; bf16 lo rows at 64 x 2 under a 128 cap
# 0.960x against 128 x 3's 0.945-0.949x (64 x 3 0.955x, 64 x 4 0.952-0.954x, 32-token tiles 0.84-0.91x).
TILES = {FMT_FP32: DecodeTiles(32, 3),
         FMT_FP16: DecodeTiles(32, 5, tail_early=True, maxnreg=128, heads_first_past_one_wave=True,
                               one_wave=(128, 5), past_one_wave=(64, 2, 0)),
         FMT_BF16: DecodeTiles(128, 3, heads_first=True, tail_early=True, lo_rows_deep_stages=5,
                               past_one_wave=(64, 2, 128)),
         FMT_E4M3: DecodeTiles(128, 1, native_cvt=True), FMT_E5M2: DecodeTiles(128, 1, pad_rows=False),
         FMT_INT8: DecodeTiles(128, 3, split_codes=1), FMT_INT4: DecodeTiles(32, 5, pad_rows=False)}


def lo_rows_launch(args: dict, splits: int, deep_stages: int, batch: int, kv_heads: int, context: int,
                   sms: int, block_n: int, resident: Callable[[dict], int],
                   contexts: BatchContexts | None = None) -> tuple[dict, int]:
    """(kernel arguments, splits) for bf16 pages at G <= 8, given the hi + lo launch (`args`, `splits`)
    and `resident(args)`, the programs an SM of a variant. One p . v dot with p's lo part in the padding
    rows (LO_ROWS) takes 168 registers where two dots take 213 (sm_90): 3 programs an SM instead of 2
    at 128-token tiles, and at 5 stages (140 KB of shared memory) 1. A variant's own residency sets its
    split count, and the choice follows what that does to the waves (H200, docs/kernels.md):
    1. where the lo-rows launch at `deep_stages` fits one wave (one program an SM, the deepest
       pipeline each takes): 16 x 16,384 0.961 -> 0.981x SDPA, 8 x 32,768 0.971 -> 0.993x;
    2. else where the lo-rows kernel needs no split: 256 x 1,024 0.941 -> 0.950x;
    3. else the two dots: at 64 x 4,096 the lo-rows kernel would split 3 ways (0.938x against 0.965x),
       and unsplit on 3 programs an SM its 512 programs leave a second wave 30 % full (0.82x).
    A variant that does not fit the GPU (`resident` 0: a smaller GPU's shared memory) is passed over."""
    deep = dict(args, LO_ROWS=True, num_stages=deep_stages)
    s = one_wave_splits(deep, batch, kv_heads, context, sms, block_n, resident, contexts)
    if s:
        return deep, s
    lo = dict(args, LO_ROWS=True)
    r = resident(lo)
    if r and num_splits(batch, kv_heads, context, sms, r, block_n, contexts) == 1:
        return lo, 1
    return args, splits


def one_wave_splits(args: dict, batch: int, kv_heads: int, context: int, sms: int, block_n: int,
                    resident: Callable[[dict], int], contexts: BatchContexts | None = None) -> int:
    """The split count of the launch `args` (tiles of `block_n` tokens) where its programs, split by its
    own residency, all fit on the SMs at once; 0 where they do not, or it does not load on this GPU."""
    r = resident(args)
    s = num_splits(batch, kv_heads, context, sms, max(1, r), block_n, contexts)
    return s if r and waves(batch, kv_heads, sms * r, s, contexts) == 1 else 0


def one_wave_launch(args: dict, splits: int, tile: tuple[int, int], batch: int, kv_heads: int, context: int,
                    sms: int, resident: Callable[[dict], int],
                    contexts: BatchContexts | None = None) -> tuple[dict, int]:
    """(kernel arguments, splits): the launch at `tile` (tokens a tile, pipeline depth; no register cap)
    where it fits one wave, else `args` and `splits` as given. Deep pipelines hold one program an SM
    (fp16 at 128 x 5: 140 KB of shared memory), which pays where every program starts at once and
    loses where a second wave waits on the first (H200, docs/kernels.md)."""
    block_n, stages = tile
    deep = {k: v for k, v in args.items() if k != "maxnreg"} | dict(BLOCK_N=block_n, num_stages=stages)
    s = one_wave_splits(deep, batch, kv_heads, context, sms, block_n, resident, contexts)
    return (deep, s) if s else (args, splits)


def past_one_wave_launch(args: dict, splits: int, tile: tuple[int, int, int], batch: int, kv_heads: int,
                         context: int, sms: int, resident: Callable[[dict], int],
                         contexts: BatchContexts | None = None) -> tuple[dict, int]:
    """(kernel arguments, splits): the launch at `tile` (tokens a tile, pipeline depth, register cap or 0;
    the rest of `args` kept, bf16's lo rows too) where it runs unsplit in more than one wave by its own
    residency, else `args` and `splits` as given. Shallow pipelines on 64-token tiles keep more programs
    an SM where waves follow one another (H200: TILES' notes)."""
    if splits != 1:
        return args, splits
    block_n, stages, cap = tile
    shallow = {k: v for k, v in args.items() if k != "maxnreg"} | dict(BLOCK_N=block_n, num_stages=stages)
    if cap:
        shallow["maxnreg"] = cap
    r = resident(shallow)
    if r and num_splits(batch, kv_heads, context, sms, r, block_n, contexts) == 1 and \
            waves(batch, kv_heads, sms * r, 1, contexts) > 1:
        return shallow, 1
    return args, splits


def plain_constexprs(L: BlockLayout, G: int, dot: tl.dtype, *, block_n: int | None = None,
                     num_stages: int | None = None, block_h: int | None = None, native_cvt: bool | None = None,
                     split_codes: int | None = None, heads_first: bool | None = None,
                     tail_early: bool | None = None, lo_rows: bool | None = None, maxnreg: int | None = None,
                     num_warps: int = 4) -> tuple[dict, bool, bool]:
    """(the plain kernel's constexprs and launch options, whether the tile is the format's own, whether
    the shape is Llama's: head_dim 128, 16 query rows) for pages of layout `L`, G query heads a KV head
    and dot inputs `dot`, as `decode_attention.decode_attention` launches it (None: the format's choice in TILES, whose
    register cap and early tail loads hold at Llama's shape only). Also what `sm90_build` builds."""
    fmt, D = FMT_CODES[L.kv_dtype], L.head_dim
    tiles = TILES[fmt]
    own_tile = block_n is None and num_stages is None and block_h is None
    block_n = block_n or max(tiles.block_n, L.block_size)
    if block_h is None:
        block_h = triton.next_power_of_2(G) if not tiles.pad_rows else max(16, triton.next_power_of_2(G))
    # the tile's register cap, early tail loads and heads first past one wave were measured at head_dim
    # 128 with 16 query rows; at SmolLM2's 64 the early loads cost fp16 1-18 % (H200)
    llama_shape = D == 128 and block_h == 16
    if maxnreg is None and own_tile and llama_shape:
        maxnreg = tiles.maxnreg  # (at head_dim 64 it costs residency, at 256 it spills)
    if block_h < G:
        raise ValueError(f"block_h must be at least the {G} query heads per KV head, got {block_h}")
    if block_n % L.block_size:
        raise ValueError(f"block_n must be a multiple of the block size {L.block_size}, got {block_n}")
    native_cvt = tiles.native_cvt if native_cvt is None else native_cvt
    tail_early = tiles.tail_early and llama_shape if tail_early is None else tail_early
    if split_codes is None:  # the halves' score dot needs K = D / 2 >= 16 (head_dim 16 failed to compile)
        split_codes = tiles.split_codes if D >= 32 else 0
    split_codes = int(split_codes) if fmt in (FMT_E4M3, FMT_E5M2, FMT_INT8) else 0
    unit = _unit(fmt)
    consts = dict(
        V_OFF=L.v_data_offset // unit, KS_OFF=L.k_scale_offset, VS_OFF=L.v_scale_offset,
        FMT=fmt, HAS_SCALE=fmt in (FMT_E4M3, FMT_E5M2, FMT_INT8), KVH=L.kv_heads, G=G,
        BS=L.block_size, D=D, BLOCK_H=block_h, BLOCK_N=block_n,
        DOT=dot, NATIVE=native_cvt, SPLIT=split_codes,
        ASM=bool(native_cvt and os.environ.get("TRITON_INTERPRET") != "1"),  # no inline PTX there
        HEADS_FIRST=tiles.heads_first if heads_first is None else heads_first,
        TAIL_EARLY=bool(tail_early and not split_codes),
        LO_ROWS=bool(lo_rows) and fmt == FMT_BF16 and 2 * G <= block_h,
        num_warps=num_warps, num_stages=tiles.num_stages if num_stages is None else num_stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}))
    return consts, own_tile, llama_shape
