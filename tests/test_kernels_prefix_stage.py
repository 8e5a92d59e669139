"""The prefill kernel over staged prefixes (`prefix_stage.py`): long-chunk sequences' full pages
dequantized once into an fp16 workspace, the others read in place in the same launch.

CPU: Triton's interpreter at tiny shapes, a small `StagePolicy` so short chunks stage. The GPU
grid of test_kernels_attention.py stages with the default policy (its 129- to 300-token chunks).
"""
from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.metadata import SeqSlice, StagePolicy, build_attention_metadata
from kvmesh.kernels.prefill_attention import prefill_attention
from kvmesh.kernels.prefix_stage import stage_prefix
from kvmesh.kernels.torch_ref import TorchBackend, gather_pages
from kvmesh.kv.layout import BlockLayout

from test_kernels_attention import TOL, make_case, rel_l2

STAGED_DTYPES = ["bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
SHAPES = [(4, 64, 16), (1, 128, 32), (8, 64, 32)]  # (GQA ratio, head_dim, block size)
SMALL = StagePolicy(min_new_tokens=6)


def compare(cache, meta, q, k, v, kv, layer=1, **kw) -> float:
    scale = q.shape[-1] ** -0.5
    ref = TorchBackend().attend(cache, layer, q, k, v, meta, scale)
    out = prefill_attention(cache, layer, q, k, v, meta, scale, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = rel_l2(out, ref)
    assert err <= TOL[kv], f"{kv}: relative L2 {err:.2e} > {TOL[kv]}"
    return err


@pytest.mark.parametrize("kv", STAGED_DTYPES)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_staged_extend_matches_torch(kv, shape):
    gqa, head_dim, bs = SHAPES[(shape + STAGED_DTYPES.index(kv)) % len(SHAPES)]
    # staged: pages + tail with a long chunk, exact pages; in place: a decode row, a short extend;
    # no prefix at all: nothing to stage
    prefix, new = [2 * bs + 3, bs, 3 * bs, bs + 2, 0], [9, 1, 6, 5, bs + 5]
    cache, meta, q, k, v = make_case(kv, gqa, head_dim, bs, prefix, new, stage=SMALL,
                                     model_dtype=torch.float16 if kv != "bf16" and shape == 2 else None)
    rows = meta.stage.tables
    assert [bool((rows[i] >= 0).any()) for i in range(len(prefix))] == [True, False, True, False, False]
    assert int((rows >= 0).sum()) == meta.stage.src_pages.numel() == 2 + 3
    staged = compare(cache, meta, q, k, v, kv)
    in_place = compare(cache, meta, q, k, v, kv, staging=False)
    assert abs(staged - in_place) < TOL[kv]


def test_shared_prefix_pages_stage_once():
    # two sequences over the same three pages (a prefix-cache hit): three workspace pages
    cache, meta, q, k, v = make_case("int8", 4, 64, 16, [48, 48], [7, 7], stage=SMALL)
    tables = meta.block_tables.tolist()
    seqs = [SeqSlice(48, 7, tables[0][:3] + tables[i][3:], int(meta.residual_slots[i])) for i in range(2)]
    shared = build_attention_metadata(seqs, cache.layout, cache.num_residual_slots, "cpu", SMALL)
    assert shared.stage.src_pages.tolist() == tables[0][:3]
    assert shared.stage.tables[:, :3].tolist() == [[0, 1, 2], [0, 1, 2]]
    compare(cache, shared, q, k, v, "int8")


def test_stage_budget_leaves_the_rest_in_place():
    layout = BlockLayout(num_layers=2, kv_heads=2, head_dim=64, block_size=16, kv_dtype="fp8_e4m3")
    page = 2 * 2 * 16 * 64 * 2  # fp16 K and V of one layer
    cache, meta, q, k, v = make_case("fp8_e4m3", 4, 64, 16, [32, 48], [8, 8],
                                     stage=StagePolicy(min_new_tokens=6, max_bytes=4 * page))
    assert meta.stage.tables[0, :2].tolist() == [0, 1] and (meta.stage.tables[1] == -1).all()
    compare(cache, meta, q, k, v, "fp8_e4m3")
    seqs = [SeqSlice(32, 8, [1, 2, 3]), SeqSlice(40, 8, [4, 5, 6])]
    for dtype in ("fp16", "fp32"):  # nothing to dequantize
        lay = BlockLayout(num_layers=1, kv_heads=2, head_dim=64, block_size=16, kv_dtype=dtype)
        assert build_attention_metadata(seqs, lay, 2, "cpu", SMALL).stage is None
    assert build_attention_metadata(seqs, layout, 2, "cpu").stage is None  # default: 128 new tokens


@pytest.mark.parametrize("kv", STAGED_DTYPES)
def test_workspace_holds_the_dequantized_pages(kv):
    cache, meta, q, k, v = make_case(kv, 2, 64, 16, [40, 35], [6, 6], stage=SMALL)
    src = meta.stage.src_pages
    work = stage_prefix(cache, 1, meta.stage)  # [P, 2, KVH, BS, D]
    ref_k, ref_v = gather_pages(cache.layer_view(1), kv, src.long())  # [KVH, P, BS, D] fp32
    for got, ref in ((work[:, 0], ref_k), (work[:, 1], ref_v)):
        ref = ref.transpose(0, 1)
        assert rel_l2(got, ref) <= 4e-4  # one fp16 rounding: at most 2**-11 relative, ~2.8e-4 rms


@pytest.mark.gpu
@pytest.mark.parametrize("kv", STAGED_DTYPES)
def test_gpu_staged_prefill(kv):
    # real heads; the default policy stages the two long chunks and reads the decode row in place;
    # fp16 and bf16 models (a bf16 model's q, k, v go to fp16 for the staged kernel, out comes back
    # bf16); the same step with every page read in place beside it
    errors = {}
    for model in ((torch.bfloat16,) if kv == "bf16" else (torch.float16, torch.bfloat16)):
        cache, meta, q, k, v = make_case(kv, 4, 128, 16, [1000, 2048, 37], [600, 256, 1], kv_heads=8,
                                         device="cuda", model_dtype=model)
        assert [bool((r >= 0).any()) for r in meta.stage.tables] == [True, True, False]
        scale = 128 ** -0.5
        ref = TorchBackend().attend(cache, 1, q, k, v, meta, scale)
        for staging in (True, False):
            out = prefill_attention(cache, 1, q, k, v, meta, scale, staging=staging)
            assert out.dtype == model
            errors[(str(model), staging)] = rel_l2(out, ref)
    assert max(errors.values()) <= TOL[kv], f"{kv}: relative L2 (model, staged) {errors}"
