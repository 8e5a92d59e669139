"""The plain decode kernel's launch choices for bf16 pages (`decode_tiles.lo_rows_launch`), fp16 pages
(`decode_tiles.one_wave_launch`) and both unsplit past one wave (`decode_tiles.past_one_wave_launch`): at the four benchmark cases, with the residencies the sm_90 builds give
(bf16 hi + lo dots at 128-token tiles and 3 stages: 213 registers, 2 programs an SM; lo rows: 168, 3; lo
rows at 5 stages: 140 KB of shared memory, 1; checked against a real build by
tests/test_kernels_sm90_build.py; fp16 at 32 x 5 under its 128 cap: 4, at 128 x 5: 1; at 64 x 2 126
registers: 4; bf16 lo rows at 64 x 2 under a 128 cap: 4), they take what the H200 measured fastest
(docs/kernels.md)."""
from __future__ import annotations

import pytest

from kvmesh.kernels.decode_tiles import TILES, lo_rows_launch, one_wave_launch, past_one_wave_launch
from kvmesh.kernels.formats import FMT_BF16, FMT_FP16
from kvmesh.kernels.splits import Residency, num_splits, slot_cost

SMS, KVH, BLOCK_N = 132, 8, 128


def resident(args: dict) -> int:
    if not args.get("LO_ROWS"):
        return 2
    return 1 if args["num_stages"] == 5 else 3


@pytest.mark.parametrize("batch,ctx,want", [(64, 4096, ("two dots", 1)), (16, 16384, ("deep", 1)),
                                            (256, 1024, ("lo rows", 1)), (8, 32768, ("deep", 2))])
def test_bf16_launch_at_the_benchmark_cases(batch, ctx, want):
    base = dict(LO_ROWS=False, num_stages=TILES[FMT_BF16].num_stages)
    splits = num_splits(batch, KVH, ctx + 1, SMS, resident(base), BLOCK_N)
    args, s = lo_rows_launch(base, splits, TILES[FMT_BF16].lo_rows_deep_stages, batch, KVH, ctx + 1, SMS,
                             BLOCK_N, resident)
    kind = "two dots" if not args["LO_ROWS"] else "deep" if args["num_stages"] == 5 else "lo rows"
    assert (kind, s) == want
    assert base == dict(LO_ROWS=False, num_stages=3)  # the caller's arguments are not changed in place


def test_deep_launch_fills_at_most_one_wave():
    # wherever the deep variant is taken, its programs fit the SMs at once
    for batch in (1, 2, 4, 8, 16, 17, 33, 64):
        for ctx in (512, 2048, 8192, 65536):
            base = dict(LO_ROWS=False, num_stages=3)
            splits = num_splits(batch, KVH, ctx, SMS, 2, BLOCK_N)
            args, s = lo_rows_launch(base, splits, 5, batch, KVH, ctx, SMS, BLOCK_N, resident)
            if args["LO_ROWS"] and args["num_stages"] == 5:
                assert batch * KVH * s <= SMS
            elif not args["LO_ROWS"]:
                assert s == splits


def test_a_variant_that_does_not_fit_the_gpu_is_passed_over():
    # a GPU with ~100 KB of shared memory an SM: the 5-stage variant (140 KB) does not load (0 programs)
    def small_gpu(args: dict) -> int:
        return 0 if args["num_stages"] == 5 else resident(args)

    for batch, ctx, want in [(16, 16384, "two dots"), (256, 1024, "lo rows")]:
        base = dict(LO_ROWS=False, num_stages=3)
        splits = num_splits(batch, KVH, ctx + 1, SMS, 2, BLOCK_N)
        args, s = lo_rows_launch(base, splits, 5, batch, KVH, ctx + 1, SMS, BLOCK_N, small_gpu)
        assert args["num_stages"] == 3 and ("lo rows" if args["LO_ROWS"] else "two dots") == want
        assert not args["LO_ROWS"] or s == 1


def test_residency_of_a_variant_that_does_not_load_is_zero():
    import torch
    from triton.runtime.errors import OutOfResources

    class TooBig:
        def _init_handles(self):
            raise OutOfResources(143360, 101376, "shared memory")

    # the probe runs for CUDA devices only; it fails before it reads the device's properties
    assert Residency().get(("deep",), torch.device("cuda"), TooBig) == 0
    # and the register-cap choice of the direct kernels never takes such a variant
    assert slot_cost(64, 8, 4096, SMS, 0, 3) == float("inf") > slot_cost(64, 8, 4096, SMS, 12, 3)


def fp16_resident(args: dict) -> int:
    # fp16 pages at 32-token tiles, 5 stages, a 128-register cap: 4 programs an SM; at 64 x 2 too; at 128 x 5: 1
    return 1 if args["BLOCK_N"] == 128 else 4


@pytest.mark.parametrize("batch,ctx,past", [(64, 4096, False), (16, 16384, False), (256, 1024, True),
                                            (8, 32768, False), (128, 2048, True)])
def test_unsplit_launches_past_one_wave_take_the_shallow_tile(batch, ctx, past):
    """fp16: 64 x 2 uncapped; bf16 lo rows: 64 x 2 under a 128 cap; only where the launch runs
    unsplit in more than one wave (256 x 1,024 among the benchmark's cases)."""
    fp16 = TILES[FMT_FP16]
    base = dict(BLOCK_N=fp16.block_n, num_stages=fp16.num_stages, maxnreg=fp16.maxnreg)
    splits = num_splits(batch, KVH, ctx + 1, SMS, fp16_resident(base), fp16.block_n)
    args, s = one_wave_launch(base, splits, fp16.one_wave, batch, KVH, ctx + 1, SMS, fp16_resident)
    args, s = past_one_wave_launch(args, s, fp16.past_one_wave, batch, KVH, ctx + 1, SMS, fp16_resident)
    assert (args["BLOCK_N"] == 64) == past
    if past:
        assert s == 1 and args["num_stages"] == 2 and "maxnreg" not in args
    lo = dict(LO_ROWS=True, BLOCK_N=128, num_stages=3)
    args, s = past_one_wave_launch(lo, 1, TILES[FMT_BF16].past_one_wave, batch, KVH, ctx + 1, SMS,
                                   lambda a: 4 if a["BLOCK_N"] == 64 else 3)
    want = dict(LO_ROWS=True, BLOCK_N=64, num_stages=2, maxnreg=128) if batch * KVH > SMS * 4 else lo
    assert (args, s) == (want, 1)
    assert past_one_wave_launch(lo, 2, TILES[FMT_BF16].past_one_wave, batch, KVH, ctx + 1, SMS,
                                lambda a: 4) == (lo, 2)  # split launches keep their tile


@pytest.mark.parametrize("batch,ctx,want", [(64, 4096, (32, 1)), (16, 16384, (128, 1)),
                                            (256, 1024, (32, 1)), (8, 32768, (128, 2))])
def test_fp16_takes_its_deep_tile_where_the_launch_fits_one_wave(batch, ctx, want):
    tiles = TILES[FMT_FP16]
    base = dict(BLOCK_N=tiles.block_n, num_stages=tiles.num_stages, maxnreg=tiles.maxnreg)
    splits = num_splits(batch, KVH, ctx + 1, SMS, fp16_resident(base), tiles.block_n)
    args, s = one_wave_launch(base, splits, tiles.one_wave, batch, KVH, ctx + 1, SMS, fp16_resident)
    assert (args["BLOCK_N"], s) == want
    if args["BLOCK_N"] == 128:  # the deep tile runs uncapped at 5 stages, its programs all at once
        assert "maxnreg" not in args and args["num_stages"] == 5 and batch * KVH * s <= SMS
    else:
        assert args == base and s == splits


def test_fp16_deep_tile_is_passed_over_where_it_does_not_load():
    tiles = TILES[FMT_FP16]
    base = dict(BLOCK_N=tiles.block_n, num_stages=tiles.num_stages, maxnreg=tiles.maxnreg)
    args, s = one_wave_launch(base, 3, tiles.one_wave, 16, KVH, 16385, SMS,
                              lambda a: 0 if a["BLOCK_N"] == 128 else 4)
    assert (args, s) == (base, 3)


@pytest.mark.parametrize("head_dim, want", [(16, 0), (32, 1), (128, 1)])
def test_int8_splits_its_codes_only_where_the_halves_dot_compiles(head_dim, want):
    """The even/odd halves' score dot has K = head_dim / 2, which Triton needs >= 16: at head_dim 16
    the int8 tile reads whole codes (it failed to compile on the H200 there)."""
    import triton.language as tl
    from kvmesh.kernels.decode_tiles import plain_constexprs
    from kvmesh.kv.layout import BlockLayout
    layout = BlockLayout(num_layers=2, kv_heads=2, head_dim=head_dim, block_size=16, kv_dtype="int8")
    consts, _, _ = plain_constexprs(layout, 2, tl.float16)
    assert consts["SPLIT"] == want
