"""A ragged decode batch's work list (`kvmesh.kernels.work_list`): each sequence split in proportion
to its context. The plan's packing and the split count on the host; the Triton kernels (plain and
INT4 tile) under the interpreter against the torch reference and against one split count for every
sequence; the register-direct Gluon kernels on the GPU (`-m gpu`), fused and second-launch reductions.
Tolerances as in test_kernels_attention.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvmesh.kernels.decode_attention import decode_attention
from kvmesh.kernels.decode_direct import decode_direct
from kvmesh.kernels.decode_int4_direct import decode_int4_direct
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata
from kvmesh.kernels.splits import num_splits, slot_cost, waves
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kernels.work_list import SPARE_UNIT, BatchContexts, WorkPlan, fill_fixed, fixed_splits
from kvmesh.kv.layout import BlockLayout
from test_kernels_attention import TOL, make_case, rel_l2


def unpack(work: torch.Tensor) -> list[tuple[int, int, int]]:
    w = work.tolist()
    return [(e >> 16, (e >> 8) & 255, e & 255) for e in w]


def test_plan_splits_each_sequence_in_proportion():
    ctx = BatchContexts.of([401, 18, 1, 100, 201])
    assert ctx.splits_of(4).tolist() == [4, 1, 1, 1, 3]  # ceil(4 x context / 401)
    plan = ctx.plan(4, torch.device("cpu"))
    assert unpack(plan.work) == [(0, 0, 4), (0, 1, 4), (0, 2, 4), (0, 3, 4), (1, 0, 1), (2, 0, 1), (3, 0, 1),
                                 (4, 0, 3), (4, 1, 3), (4, 2, 3)]
    assert [(e >> 8, e & 255) for e in plan.seq_units.tolist()] == [(0, 4), (4, 1), (5, 1), (6, 1), (7, 3)]
    assert plan.units == ctx.units(4) == 10 and ctx.pays(4) and not ctx.pays(1)
    assert ctx.plan(4, torch.device("cpu")) is plan  # once per step, reused by every layer
    big = BatchContexts.of([70000] + [1] * 7)
    assert big.splits_of(128).tolist() == [128] + [1] * 7 and max(u[2] for u in unpack(big.plan(128, "cpu").work)) == 128


def test_fixed_capacity_work_list():
    """A CUDA graph's list: the units of the plan at the splits that fit, then spare units to the end."""
    ctx = np.array([401, 18, 1, 100, 201], dtype=np.int64)
    assert fixed_splits(ctx, 10, 1) == 4  # 4 splits: 10 units (5 splits: 5 + 1 + 1 + 2 + 3 = 12)
    assert fixed_splits(ctx, 10, 128) == 3  # no split of the longest under 128 tokens
    assert fixed_splits(ctx, 4, 1) == 1  # nothing fits: one unit each (the caller keeps the uniform graph)
    work, seq_units = np.zeros(13, dtype=np.int32), np.zeros(5, dtype=np.int32)
    assert fill_fixed(ctx, 4, work, seq_units) == 10
    plan = BatchContexts.of(ctx.tolist()).plan(4, torch.device("cpu"))
    assert work[:10].tolist() == plan.work.tolist() and seq_units.tolist() == plan.seq_units.tolist()
    assert work[10:].tolist() == [SPARE_UNIT] * 3 and unpack(torch.tensor([SPARE_UNIT])) == [(0, 255, 255)]
    with pytest.raises(ValueError, match="do not fit"):
        fill_fixed(ctx, 6, work, seq_units)


def _fixed_plan(meta, capacity: int, min_tokens: int = 32) -> WorkPlan:
    """The step's fixed-capacity work list, as a graph's batch fills it."""
    ctx = (meta.prefix_lens.cpu().numpy().astype(np.int64) + 1)
    work, seq_units = np.zeros(capacity, dtype=np.int32), np.zeros(ctx.shape[0], dtype=np.int32)
    fill_fixed(ctx, fixed_splits(ctx, capacity, min_tokens), work, seq_units)
    dev = meta.prefix_lens.device
    return WorkPlan(0, torch.from_numpy(work).to(dev), torch.from_numpy(seq_units).to(dev))


def test_uniform_batches_and_chunks_keep_one_count():
    layout = BlockLayout(num_layers=1, kv_heads=2, head_dim=16, block_size=16, kv_dtype="fp16")

    def meta(prefixes, new):
        seqs = [SeqSlice(p, n, list(range(i * 8, i * 8 + (p + n) // 16 + 1)), i) for i, (p, n) in
                enumerate(zip(prefixes, new))]
        return build_attention_metadata(seqs, layout, 4, "cpu")
    assert meta([40, 40, 40], [1, 1, 1]).contexts is None  # every sequence the longest: one count
    assert meta([40, 3, 0], [1, 5, 1]).contexts is None  # not a decode step
    assert meta([40, 3, 0], [1, 1, 1]).contexts.lens.tolist() == [41, 4, 1]
    assert BatchContexts.of([7]) is None and BatchContexts.of([]) is None


def test_split_count_of_a_ragged_batch():
    """One 32K sequence among 63 of 1K: one count for all gives the long one 4 splits (its programs
    stream 8K tokens each, alone, after the rest) or, counted for the batch's work, 28 splits for
    every sequence (14,336 programs, most near-empty). The work list splits the long one 75 ways
    and the short ones 3: 264 units x 8 KV heads, one full wave of programs of <= 437 tokens."""
    lens = [32769] + [1025] * 63
    ctx = BatchContexts.of(lens)
    s = num_splits(64, 8, 32769, 132, 16, 16, ctx)
    assert s == 75 and ctx.splits_of(s).tolist() == [75] + [3] * 63
    assert ctx.choices == {(64, 8, 32769, 132, 16, 16): 75}  # chosen once a step; every layer asks
    assert 8 * ctx.units(s) == 132 * 16  # one wave, full
    one = num_splits(64, 8, 32769, 132, 16, 16)
    assert one == 4
    assert slot_cost(64, 8, 32769, 132, 16, s, ctx) < slot_cost(64, 8, 32769, 132, 16, one) / 10
    # a count the work list does not pay at (one split) costs what it costs every sequence
    assert waves(64, 8, 132 * 16, 1, ctx) == waves(64, 8, 132 * 16, 1)


@pytest.mark.parametrize("work", [False, True])
@pytest.mark.parametrize("hb,sb", [(1, 4), (4, 2), (4, 16)])
def test_reduce_splits_kernel_matches_torch(work, hb, sb):
    """The second-launch reduction, several steps of splits (9 splits, 2-4 a step) and heads not a
    multiple of a program's (6 heads, 4 a program), some splits empty (lse -inf): against log-sum-exp
    weights in torch, for the [B, H, splits] partials and a work list's [U, H] rows."""
    from kvmesh.kernels.partials import reduce_splits_kernel

    g = torch.Generator().manual_seed(hb * sb + work)
    B, H, D, S = 3, 6, 16, 9
    n = [9, 1, 4] if work else [S] * B  # each sequence's splits
    ctx = BatchContexts.of([90, 10, 40] if work else [1, 2])
    seq_units = ctx.plan(S, torch.device("cpu")).seq_units if work else torch.zeros(B, dtype=torch.int32)
    rows = sum(n) if work else B * S
    part = torch.randn(rows, H, D, generator=g)
    lse = torch.randn(rows, H, generator=g) * 4
    lse[1, 2] = float("-inf")  # an empty split
    if work:
        first = [0, 9, 10]
        parts = [(part[f:f + k], lse[f:f + k]) for f, k in zip(first, n)]  # [k, H, D], [k, H]
        po, pl = part, lse
    else:
        po, pl = part.view(B, S, H, D).transpose(1, 2).contiguous(), lse.view(B, S, H).transpose(1, 2).contiguous()
        parts = [(po[b].transpose(0, 1), pl[b].transpose(0, 1)) for b in range(B)]
    want = torch.stack([(o * torch.softmax(w * 0.6931471805599453, 0)[..., None]).sum(0) for o, w in parts])
    out = torch.empty(B, H, D)
    reduce_splits_kernel[(B, -(-H // hb))](po, pl, out, out.stride(0), out.stride(1), seq_units,
                                           H=H, SPLITS=S, D=D, HB=hb, SB=sb, WORK=work)
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-5)


DECODE_KERNELS = [("fp16", None), ("bf16", None), ("fp8_e5m2", False), ("int8", False), ("int4", False)]


@pytest.mark.parametrize("kv,direct", DECODE_KERNELS)
@pytest.mark.parametrize("splits", [2, 5, None])
def test_work_list_decode_matches_torch(kv, direct, splits):
    # ragged: one long sequence, short ones, an empty prefix, residual-only, exact pages
    lens = [200, 17, 0, 64, 33, 15]
    cache, meta, q, k, v = make_case(kv, 4, 64, 16, lens, [1] * len(lens), seed=len(kv) + (splits or 0))
    assert meta.contexts is not None
    scale = 64 ** -0.5
    ref = TorchBackend().attend(cache, 1, q, k, v, meta, scale)
    out = decode_attention(cache, 1, q, k, v, meta, scale, splits=splits, direct=direct)
    one = decode_attention(cache, 1, q, k, v, dataclasses.replace(meta, contexts=None), scale, splits=splits,
                           direct=direct)
    assert rel_l2(out, ref) <= TOL[kv] and rel_l2(one, ref) <= TOL[kv]
    assert rel_l2(out, one) <= TOL[kv]


@pytest.mark.parametrize("kv,direct", DECODE_KERNELS)
def test_fixed_work_list_decode_matches_torch(kv, direct):
    """The kernels over a graph's fixed list (spare units past the step's, split counts they did not
    choose): the torch reference's output; the spare units change nothing."""
    lens = [200, 17, 0, 64, 33, 15]
    cache, meta, q, k, v = make_case(kv, 4, 64, 16, lens, [1] * len(lens), seed=3 + len(kv))
    fixed = dataclasses.replace(meta, contexts=None, work=_fixed_plan(meta, 24))
    assert (fixed.work.work == SPARE_UNIT).sum() >= 4 and unpack(fixed.work.work)[0][2] > 2
    scale = 64 ** -0.5
    ref = TorchBackend().attend(cache, 1, q, k, v, meta, scale)
    out = decode_attention(cache, 1, q, k, v, fixed, scale, direct=direct)
    assert rel_l2(out, ref) <= TOL[kv]
    work = fixed.work.work.clone()
    work[work >> 16 == 3] = SPARE_UNIT  # sequence 3's units gone: the launch read the list, so its rows go wrong
    broken = dataclasses.replace(fixed, work=dataclasses.replace(fixed.work, work=work))
    out = decode_attention(cache, 1, q, k, v, broken, scale, direct=direct)
    assert rel_l2(out[[0, 1, 2, 4, 5]], ref[[0, 1, 2, 4, 5]]) <= TOL[kv] and not rel_l2(out[3], ref[3]) <= TOL[kv]


# ----------------------------------------------------------------------------- GPU (H200)

@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8", "int4", "fp16", "bf16"])
@pytest.mark.parametrize("gqa,head_dim,bs", [(4, 128, 16), (8, 64, 32), (16, 128, 16)])
def test_gpu_work_list_decode(kv, gqa, head_dim, bs):
    # every decode kernel over a ragged batch: the work list against one count for all and the
    # torch reference, split reductions fused (3 splits) and in a second launch (7, 128)
    lens = [0, 17, 20000, 3000, 64, 2049, 511, 129, bs - 1, bs]
    for model in (torch.float16, torch.bfloat16):
        if kv in ("fp16", "bf16") and model != {"fp16": torch.float16, "bf16": torch.bfloat16}[kv]:
            continue
        cache, meta, q, k, v = make_case(kv, gqa, head_dim, bs, lens, [1] * len(lens), kv_heads=8,
                                         device="cuda", seed=gqa, model_dtype=model)
        scale = head_dim ** -0.5
        ref = TorchBackend().attend(cache, 1, q, k, v, meta, scale)
        one_count = dataclasses.replace(meta, contexts=None)
        for splits in (None, 3, 7, 128):
            kernels = [lambda m: decode_attention(cache, 1, q, k, v, m, scale, splits=splits)]
            if kv in ("fp8_e4m3", "fp8_e5m2", "int8") and splits in (3, 7):
                kernels.append(lambda m: decode_direct(cache, 1, q, k, v, m, scale, splits=splits, fused=True))
            if kv == "int4" and splits in (3, 7):
                kernels.append(lambda m: decode_int4_direct(cache, 1, q, k, v, m, scale, splits=splits, fused=True))
            for attend in kernels:
                out = attend(meta)
                err = rel_l2(out, ref)
                assert err <= TOL[kv], f"{kv} G={gqa} D={head_dim} splits={splits}: {err:.2e}"
                if splits is None or splits <= 7:
                    assert rel_l2(attend(one_count), ref) <= TOL[kv]
        # a CUDA graph's fixed list, spare units to the end, whatever split count the launcher picks
        fixed = dataclasses.replace(meta, contexts=None, work=_fixed_plan(meta, 400, 256))
        kernels = [lambda m: decode_attention(cache, 1, q, k, v, m, scale)]
        if kv in ("fp8_e4m3", "fp8_e5m2", "int8"):
            kernels += [lambda m: decode_direct(cache, 1, q, k, v, m, scale, splits=s, fused=True) for s in (1, 3)]
        if kv == "int4":
            kernels += [lambda m: decode_int4_direct(cache, 1, q, k, v, m, scale, splits=s, fused=True)
                        for s in (1, 3)]
        for attend in kernels:
            err = rel_l2(attend(fixed), ref)
            assert err <= TOL[kv], f"{kv} G={gqa} D={head_dim} fixed work list: {err:.2e}"
