"""Launch choices of the plain decode kernel (`decode_attention.py`) per KV format: its tile, pipeline
depth and grid order, and for bf16 pages which form of p . v a launch takes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvmesh.kernels.formats import FMT_BF16, FMT_E4M3, FMT_E5M2, FMT_FP16, FMT_FP32, FMT_INT4, FMT_INT8
from kvmesh.kernels.splits import num_splits


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


# Fastest on the H200 over 64 x 4096 and 16 x 16384 (benchmarks/decode_sweep.py, docs/kernels.md).
# bf16 heads first: +1 % at 64 x 4096 and 256 x 1024, = elsewhere (fp16: +0.9 % at 256 x 1024, -0.4-0.6 %
# at two others: not kept). H200, two runs of benchmarks/decode_direct_sweep.py (docs/decode_direct.md).
# fp16/bf16 tail_early: +1.2 / +1.5 % at 256 x 1,024, bf16 +0.8 % at 16 x 16,384 and 8 x 32,768, = elsewhere;
# fp16 heads first past one wave: +0.8-1.2 % at 256 x 1,024 (the only case it changes).
TILES = {FMT_FP32: DecodeTiles(32, 3),
         FMT_FP16: DecodeTiles(32, 5, tail_early=True, maxnreg=128, heads_first_past_one_wave=True),
         FMT_BF16: DecodeTiles(128, 3, heads_first=True, tail_early=True, lo_rows_deep_stages=5),
         FMT_E4M3: DecodeTiles(128, 1, native_cvt=True), FMT_E5M2: DecodeTiles(128, 1, pad_rows=False),
         FMT_INT8: DecodeTiles(128, 3, split_codes=1), FMT_INT4: DecodeTiles(32, 5, pad_rows=False)}


def lo_rows_launch(args: dict, splits: int, deep_stages: int, batch: int, kv_heads: int, context: int,
                   sms: int, block_n: int, resident: Callable[[dict], int]) -> tuple[dict, int]:
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
    r = resident(deep)
    s = num_splits(batch, kv_heads, context, sms, max(1, r), block_n)
    if r and batch * kv_heads * s <= sms * r:
        return deep, s
    lo = dict(args, LO_ROWS=True)
    r = resident(lo)
    if r and num_splits(batch, kv_heads, context, sms, r, block_n) == 1:
        return lo, 1
    return args, splits
