"""Triton paged attention (decode and prefill/extend) against the pure-torch `TorchBackend`.

CPU: Triton's interpreter at tiny shapes. The grid covers every KV dtype, each with a rotation of
GQA ratio (1/4/8), head_dim (64/128) and block size (16/32), so every value of each axis meets every
dtype at least once without the full product (the interpreter runs ~0.5 ms per program).
Batches are ragged (prefix 0, a multiple of the block size, with a residual tail), pages are in random
order and page 0 is never used (a wrong table read shows). GPU (`-m gpu`): the same comparisons at
real shapes, plus a pool of more than 65,536 pages so 32-bit byte offsets would overflow.
Tolerance: relative L2 against the reference computed from the same (dequantized) cache.
"""
from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.decode_attention import decode_attention, num_splits, resident_programs
from kvmesh.kernels.splits import slot_cost
from kvmesh.kernels.decode_direct import decode_direct
from kvmesh.kernels.decode_direct import supports as decode_direct_supports
from kvmesh.kernels.metadata import SeqSlice, StagePolicy, build_attention_metadata
from kvmesh.kernels.prefill_attention import prefill_attention
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kernels.triton_backend import TritonBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.kv.quant import quantize_blocks, store_blocks

DTYPES = ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
TOL = {"fp32": 1e-3, "fp16": 1e-3, "bf16": 1e-3, "fp8_e4m3": 2e-3, "fp8_e5m2": 2e-3, "int8": 2e-3, "int4": 2e-3}
SHAPES = [(1, 64, 16), (4, 128, 32), (8, 64, 32), (4, 64, 16)]  # (GQA ratio, head_dim, block size)
GRID = [(dt, *SHAPES[(i + j) % len(SHAPES)]) for i, dt in enumerate(DTYPES) for j in range(2)]
MODEL_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def make_case(kv: str, gqa: int, head_dim: int, bs: int, prefix_lens: list[int], num_new: list[int],
              *, kv_heads: int = 2, num_layers: int = 2, layer: int = 1, device: str = "cpu",
              first_page: int = 1, spare_pages: int = 3, seed: int = 0, model_dtype: torch.dtype | None = None,
              stage: StagePolicy = StagePolicy(), split_mixed: bool = False):
    """A cache with random quantized pages in random order and random residual tails, the metadata
    of one step, and q/k/v for its new tokens. Pages come from [first_page, first_page + needed)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    model_dtype = model_dtype or MODEL_DTYPE.get(kv, torch.float32)
    layout = BlockLayout(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, block_size=bs, kv_dtype=kv)
    need = sum(-(-(p + n) // bs) for p, n in zip(prefix_lens, num_new))
    n_pages = first_page + need + spare_pages
    cache = KVCache(layout, n_pages, len(prefix_lens) + 1, model_dtype, device)
    cache.residual.copy_(torch.randn(cache.residual.shape, generator=g).to(model_dtype))
    ids = first_page + torch.randperm(need + spare_pages, generator=g)
    kk = torch.randn(need + spare_pages, bs, kv_heads, head_dim, generator=g) * 3  # keys larger, as in LLMs
    vv = torch.randn(need + spare_pages, bs, kv_heads, head_dim, generator=g)
    store_blocks(cache.layer_view(layer), ids.to(device), quantize_blocks(kk.to(device), vv.to(device), kv))
    slots = torch.randperm(len(prefix_lens) + 1, generator=g)
    seqs, pos = [], 0
    for i, (p, n) in enumerate(zip(prefix_lens, num_new)):
        nb = -(-(p + n) // bs)
        seqs.append(SeqSlice(p, n, ids[pos:pos + nb].tolist(), int(slots[i])))
        pos += nb
    meta = build_attention_metadata(seqs, layout, cache.num_residual_slots, device, stage, split_mixed)
    T, H = sum(num_new), kv_heads * gqa
    q = torch.randn(T, H, head_dim, generator=g).to(device, model_dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(device, model_dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(device, model_dtype)
    return cache, meta, q, k, v


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(kv, gqa, head_dim, bs, prefix_lens, num_new, attend=None, **kw) -> float:
    cache, meta, q, k, v = make_case(kv, gqa, head_dim, bs, prefix_lens, num_new, **kw)
    layer = kw.get("layer", 1)
    scale = head_dim ** -0.5
    ref = TorchBackend().attend(cache, layer, q, k, v, meta, scale)
    out = (attend or TritonBackend().attend)(cache, layer, q, k, v, meta, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = rel_l2(out, ref)
    assert err <= TOL[kv], f"{kv} gqa={gqa} D={head_dim} bs={bs}: relative L2 {err:.2e} > {TOL[kv]}"
    return err


@pytest.mark.parametrize("kv,gqa,head_dim,bs", GRID)
def test_decode_matches_torch(kv, gqa, head_dim, bs):
    # ragged: empty prefix, residual-only, exact pages, pages + tail
    check(kv, gqa, head_dim, bs, [0, bs - 3, 2 * bs, 3 * bs + 5], [1, 1, 1, 1])


@pytest.mark.parametrize("kv,gqa,head_dim,bs", GRID)
def test_extend_matches_torch(kv, gqa, head_dim, bs):
    # chunked prefill from scratch, an extend over pages + tail, and a decode row in the same step
    check(kv, gqa, head_dim, bs, [0, 2 * bs + 3, bs], [bs + 5, 9, 1])


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("splits", [2, 3])
def test_decode_splits_match_torch(kv, splits):
    # more splits than some sequences have pages: empty splits must drop out of the reduction;
    # block_h = G: dots of 4 rows, which Triton pads itself
    def attend(cache, layer, q, k, v, meta, scale):
        return decode_attention(cache, layer, q, k, v, meta, scale, splits=splits, block_n=16,
                                block_h=4 if splits == 2 else None)
    check(kv, 4, 64, 16, [5, 16, 4 * 16 + 1], [1, 1, 1], attend=attend)


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_decode_fused_reduction_matches_second_launch(kv, monkeypatch):
    """The plain kernel's last split combining its sequence's partials (FUSED, up to 4 splits; no
    second launch) against the second launch: the torch reference's output both ways, and every
    counter back at zero."""
    from kvmesh.kernels import partials
    from kvmesh.kernels.splits import COUNTERS
    second_launch = partials.reduce_splits_kernel
    lens = [5, 16, 4 * 16 + 1, 0]
    for splits in (2, 4):
        for fused in (True, False):
            monkeypatch.setattr(partials, "reduce_splits_kernel", None if fused else second_launch)
            check(kv, 4, 64, 16, lens, [1] * len(lens), attend=lambda *a: decode_attention(
                *a, splits=splits, block_n=16, direct=False, fused=fused))
    assert COUNTERS.get(torch.device("cpu"), 8).abs().sum() == 0


@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16", "fp8_e5m2", "int8"])
def test_decode_tail_early_matches_torch(kv):
    # the tail's slot id and new K/V row loaded at the program's start; int8 with its word decode
    # keeps the late loads (codes 1), the plain decode takes the early ones
    for splits, codes in ((1, 0), (3, 0), (2, 1)):
        def attend(cache, layer, q, k, v, meta, scale):
            return decode_attention(cache, layer, q, k, v, meta, scale, splits=splits, block_n=16, direct=False,
                                    tail_early=True, split_codes=codes if kv == "int8" else None)
        check(kv, 4, 64, 16, [0, 13, 2 * 16, 3 * 16 + 5], [1, 1, 1, 1], attend=attend)


def test_decode_heads_first_past_one_wave_matches_torch():
    # 40 x 4 (sequence, KV head) programs on 132 SMs x 1: more than one wave, so fp16's grid goes heads first
    lens = [(7 * i) % 50 for i in range(40)]

    def attend(cache, layer, q, k, v, meta, scale):
        return decode_attention(cache, layer, q, k, v, meta, scale, programs_per_sm=1, direct=False)
    check("fp16", 2, 128, 16, lens, [1] * len(lens), kv_heads=4, attend=attend)  # head_dim 128: its shape


@pytest.mark.parametrize("gqa", [4, 3, 8])
def test_decode_lo_rows_match_torch(gqa):
    # bf16 pages with p's lo part in the padding query rows (one p . v dot; on the GPU the lo part is
    # what p loses in bf16, here in fp32 it is 0): forced, with and without splits, then the launcher's
    # choices at head_dim 128 (decode_tiles.lo_rows_launch): a launch that fits one wave (deep
    # pipeline), and 40 x 4 programs on 132 SMs x 1 (past a wave, unsplit)
    for splits in (1, 3):
        check("bf16", gqa, 64, 16, [0, 13, 2 * 16, 3 * 16 + 5], [1, 1, 1, 1],
              attend=lambda *a: decode_attention(*a, splits=splits, direct=False, lo_rows=True))
    check("bf16", gqa, 128, 16, [0, 13, 2 * 16, 3 * 16 + 5], [1, 1, 1, 1],
          attend=lambda *a: decode_attention(*a, direct=False))
    lens = [(7 * i) % 50 for i in range(40)]
    check("bf16", gqa, 128, 16, lens, [1] * len(lens), kv_heads=4,
          attend=lambda *a: decode_attention(*a, programs_per_sm=1, direct=False))


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("gqa,head_dim,bs", [(4, 64, 16), (1, 128, 32)])
def test_decode_split_codes_match_torch(kv, gqa, head_dim, bs):
    # 8-bit codes decoded as even/odd channel halves from 32-bit words, with and without splits
    for splits, mode in ((1, 1), (2, 1), (2, 2)):
        def attend(cache, layer, q, k, v, meta, scale):
            return decode_attention(cache, layer, q, k, v, meta, scale, splits=splits, block_n=2 * bs,
                                    split_codes=mode)
        check(kv, gqa, head_dim, bs, [0, bs - 3, 2 * bs, 3 * bs + 5], [1, 1, 1, 1], attend=attend)


@pytest.mark.parametrize("causal_split", [False, True])
def test_prefill_multiple_tiles_causal(causal_split):
    # tiles of 16 rows = 4 tokens x 4 heads: the causal mask crosses tile edges; with the causal split
    # the keys of 8-token key tiles wholly before a tile's first token go unmasked (a 27-token chunk:
    # tiles from token 8 on have such tiles)
    def attend(cache, layer, q, k, v, meta, scale):
        return prefill_attention(cache, layer, q, k, v, meta, scale, block_m=16, block_n=16 // (1 + causal_split),
                                 num_warps=4, num_stages=1, causal_split=causal_split)
    check("fp16", 4, 64, 16, [20, 0, 5], [11, 7, 27], attend=attend)


@pytest.mark.parametrize("kv,new", [("fp16", [1, 1, 9, 16]), ("int8", [9, 1, 20, 1]),
                                    ("int4", [7, 12, 1, 1]), ("bf16", [1, 5, 1, 3])])
def test_mixed_step_splits_decode_rows(kv, new):
    # decode rows first / between chunks / last: the decode kernel takes them, the prefill kernel
    # the chunks (rows as slices when contiguous, else gathered), against one torch pass
    prefix = [35, 16, 0, 50]
    cache, meta, q, k, v = make_case(kv, 4, 64, 16, prefix, new, split_mixed=True)
    m = meta.mixed
    dec = [i for i, n in enumerate(new) if n == 1]
    assert m.decode.num_seqs == len(dec) and m.prefill.num_seqs == len(new) - len(dec)
    assert m.decode.is_decode and m.prefill.max_query_len == max(new)
    contiguous = dec == list(range(dec[0], dec[0] + len(dec)))
    assert isinstance(m.decode_rows, slice) == contiguous
    ref = TorchBackend().attend(cache, 1, q, k, v, meta, 0.125)
    out = TritonBackend().attend(cache, 1, q, k, v, meta, 0.125)
    assert rel_l2(out, ref) <= TOL[kv]
    assert make_case(kv, 4, 64, 16, prefix, [1] * 4, split_mixed=True)[1].mixed is None  # pure decode


def test_decode_rejects_multi_token_step():
    cache, meta, q, k, v = make_case("fp16", 2, 64, 16, [3], [2])
    with pytest.raises(ValueError, match="one new token"):
        decode_attention(cache, 1, q, k, v, meta, 0.125)


def test_bad_shapes_name_the_tensor():
    cache, meta, q, k, v = make_case("fp16", 2, 64, 16, [3], [1])
    with pytest.raises(ValueError, match="k must be"):
        TritonBackend().attend(cache, 1, q, k[:, :1], v, meta, 0.125)
    with pytest.raises(ValueError, match="layer must be"):
        TritonBackend().attend(cache, 2, q, k, v, meta, 0.125)


def test_direct_kernel_declines_the_interpreter():
    # the Gluon kernel has no interpreter path: on the CPU decode runs the plain kernel, and asking
    # for the direct one says why instead of failing inside Triton
    cache, meta, q, k, v = make_case("fp8_e4m3", 4, 64, 16, [20], [1], model_dtype=torch.float16)
    assert not decode_direct_supports(3, q, cache.residual.dtype, 4, 64, 16)
    with pytest.raises(ValueError, match="direct decode kernel does not serve"):
        decode_attention(cache, 1, q, k, v, meta, 0.125, direct=True)


def test_direct_kernel_compile_failure_falls_back(monkeypatch):
    # a Triton whose Gluon API moved: the first compile failure turns the direct kernel off (once,
    # with a warning) and the plain kernel answers that call and the next ones
    import kvmesh.kernels.decode_direct as dd
    avail = dd.Availability()
    monkeypatch.setattr(dd, "AVAILABILITY", avail)
    monkeypatch.setattr(dd, "COMPILE_ERRORS", (RuntimeError,))
    monkeypatch.setattr(dd, "supports", lambda *a: avail.error is None)
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("gluon changed")
    monkeypatch.setattr(dd, "decode_direct", broken)
    cache, meta, q, k, v = make_case("int8", 4, 64, 16, [0, 20, 37], [1, 1, 1], model_dtype=torch.float16)
    want = decode_attention(cache, 1, q, k, v, meta, 0.125, direct=False)
    for _ in range(2):
        assert torch.equal(decode_attention(cache, 1, q, k, v, meta, 0.125), want)
    assert len(calls) == 1 and isinstance(avail.error, RuntimeError)
    with pytest.raises(ValueError, match="does not serve"):
        decode_attention(cache, 1, q, k, v, meta, 0.125, direct=True)


def test_num_splits_from_shapes():
    assert num_splits(256, 8, 1024, 132) == 1  # enough programs already
    assert num_splits(8, 8, 32768, 132) > 4  # 64 programs for 132 SMs: split the sequence
    assert num_splits(1, 8, 300, 132) == 1  # too short to split
    assert num_splits(16, 8, 16384, 132, 4) == 4  # one full wave, not 5 splits (a second wave 20 % full)
    assert num_splits(64, 8, 4096, 132, 2) == 1  # 2 waves whatever the splits: the fewest
    assert resident_programs(128, 38144, 4, 233472) == 4  # registers bound
    assert resident_programs(216, 80896, 4, 233472) == 2  # registers and shared memory bound
    # one-warp programs: a warp's registers come from its quarter of the SM (3 of 144 fit a quarter)
    assert [resident_programs(r, 0, 1, 233472) for r in (128, 144, 168)] == [16, 12, 12]


def test_register_option_by_issue_bound_cost():
    """The INT4 kernel's register cap: 16 programs an SM (128 registers, chunks 6 % slower) only where
    12 would leave a part-full last wave."""
    def cost(batch, ctx, resident, chunk_time):
        s = num_splits(batch, 8, ctx, 132, resident, 16)
        return chunk_time * slot_cost(batch, 8, ctx, 132, resident, s)
    assert cost(256, 1025, 16, 1.06) < cost(256, 1025, 12, 1.0)  # 2,048 pairs: one wave of 16 a SM
    for batch, ctx in [(64, 4097), (16, 16385), (8, 32769)]:  # full waves of 12 a SM already
        assert cost(batch, ctx, 12, 1.0) < cost(batch, ctx, 16, 1.06)


def test_wide_register_cap_follows_the_split_reduction():
    """16 head columns (G 9-16): uncapped (8 programs an SM, no spills) where its splits still fuse,
    the 168 cap (12 an SM) where a second launch reduces anyway, as measured on the H200 at 64 query /
    4 KV heads; the uncapped residency matches resident_programs at 224 registers."""
    from kvmesh.kernels.decode_direct import WIDE_CAP, WIDE_RESIDENT, wide_register_cap
    assert resident_programs(224, 512, 1, 233472) == WIDE_RESIDENT
    assert resident_programs(WIDE_CAP, 512, 1, 233472) == 12
    cases = [(64, 4096), (256, 1024), (16, 16384), (8, 32768)]
    assert [wide_register_cap(b, 4, c + 1, 132) for b, c in cases] == [None, None, WIDE_CAP, WIDE_CAP]


# ----------------------------------------------------------------------------- GPU (H200)

# G 16 through the engine's choice too: the direct kernels' two MMA n-tiles (8-bit and INT4, fp16/bf16 models)
GPU_GRID = [(dt, g, d, bs) for dt in DTYPES for (g, d, bs) in [(1, 128, 16), (4, 128, 16), (8, 64, 32), (16, 128, 16)]]


@pytest.mark.gpu
@pytest.mark.parametrize("kv,gqa,head_dim,bs", GPU_GRID)
def test_gpu_decode_and_extend(kv, gqa, head_dim, bs):
    # real head counts, ragged contexts up to 3k tokens; decode both with and without splits
    lens = [0, 17, 1000, 3000, 64, 2049, 511, 129]
    check(kv, gqa, head_dim, bs, lens, [1] * len(lens), kv_heads=8, device="cuda", num_layers=2)
    check(kv, gqa, head_dim, bs, lens, [1] * len(lens), kv_heads=8, device="cuda",
          attend=lambda *a: decode_attention(*a, splits=7))
    check(kv, gqa, head_dim, bs, [0, 700, 33, 1500], [300, 129, 1, 77], kv_heads=8, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("gqa,head_dim", [(4, 128), (8, 64), (3, 128)])
def test_gpu_decode_lo_rows(gqa, head_dim):
    # bf16 pages, p . v as one dot with p's lo bf16 part in the padding query rows
    lens = [0, 17, 1000, 3000, 64, 2049, 511, 129]
    for splits in (None, 1, 7):
        check("bf16", gqa, head_dim, 16, lens, [1] * len(lens), kv_heads=8, device="cuda",
              attend=lambda *a: decode_attention(*a, splits=splits, direct=False, lo_rows=True))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16", "fp8_e5m2"])
def test_gpu_plain_decode_tail_early(kv):
    # the plain kernel with the tail's loads at its start, with and without splits (2 and 3: the
    # last split combines the partials; 7: the second launch)
    lens = [0, 17, 1000, 3000, 64, 2049, 511, 129]
    for splits in (None, 2, 3, 7):
        check(kv, 4, 128, 16, lens, [1] * len(lens), kv_heads=8, device="cuda",
              attend=lambda *a: decode_attention(*a, splits=splits, direct=False, tail_early=True))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp16", "bf16"])
def test_gpu_plain_decode_past_one_wave(kv):
    # 160 sequences x 8 KV heads unsplit: more programs than the SMs hold at once, so the launcher
    # takes its shallow 64-token tile (decode_tiles.past_one_wave_launch)
    lens = [300 + 7 * i for i in range(160)]
    check(kv, 4, 128, 16, lens, [1] * len(lens), kv_heads=8, device="cuda",
          attend=lambda *a: decode_attention(*a, direct=False))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", DTYPES)
def test_gpu_mixed_step(kv):
    # decode rows (direct kernels where they serve) beside a staged chunk and a short extend
    lens, new = [1000, 3000, 17, 2049, 700, 0], [1, 300, 1, 1, 40, 1]
    for model in (None, torch.bfloat16) if kv not in ("fp32", "fp16", "bf16") else (None,):
        check(kv, 4, 128, 16, lens, new, kv_heads=8, device="cuda", split_mixed=True, model_dtype=model)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp16", "fp8_e4m3", "int8", "int4"])
def test_gpu_pool_past_65536_pages(kv):
    # pages >= 70,000 of a one-layer pool: page * page_bytes passes 2**32 (int64 offsets needed)
    check(kv, 4, 128, 16, [4000, 20, 1600], [1, 1, 1], kv_heads=8, num_layers=1, layer=0,
          device="cuda", first_page=70_000)
    check(kv, 4, 128, 16, [300, 1000], [200, 64], kv_heads=8, num_layers=1, layer=0,
          device="cuda", first_page=70_000)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("gqa,head_dim,bs", [(1, 128, 16), (4, 128, 16), (8, 64, 32), (3, 64, 16), (7, 128, 32),
                                             (16, 128, 16), (12, 64, 32)])
def test_gpu_direct_decode(kv, gqa, head_dim, bs):
    # the register-direct Gluon kernel (fp16 models): ragged contexts (none, residual only, exact
    # pages, pages + tail, long), its own split count, one split and more splits than some have pages
    lens = [0, 17, 1000, 3000, 64, 2049, 511, 129, bs - 1, bs]
    for splits in (None, 1, 7):
        check(kv, gqa, head_dim, bs, lens, [1] * len(lens), kv_heads=8, device="cuda", num_layers=2,
              model_dtype=torch.float16, seed=splits or 0,
              attend=lambda *a: decode_attention(*a, splits=splits, direct=True))
    for fused in (False, True):  # the split reduction in a second launch or in the last split
        check(kv, gqa, head_dim, bs, lens, [1] * len(lens), kv_heads=8, device="cuda", num_layers=2,
              model_dtype=torch.float16, seed=3, attend=lambda *a: decode_direct(*a, splits=3, fused=fused))
    for splits in (None, 5):  # a bf16 model: q, new K/V and tails to fp16 by powers of two; out in bf16
        check(kv, gqa, head_dim, bs, lens, [1] * len(lens), kv_heads=8, device="cuda", num_layers=2,
              model_dtype=torch.bfloat16, seed=4, attend=lambda *a: decode_attention(*a, splits=splits, direct=True))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("gqa,head_dim,bs", [(4, 128, 16), (8, 64, 32), (3, 128, 16), (16, 128, 16)])
def test_gpu_direct_reductions(kv, gqa, head_dim, bs):
    # the last split's one-pass reduction over 3, 4 and (forced) 7 splits, some of them empty, and
    # the second launch past FUSED_MAX_SPLITS; fp16 and bf16 models
    lens = [0, 17, 1000, 3000, 64, 2049, 511, 129, bs - 1, bs]
    for model in (torch.float16, torch.bfloat16):
        for splits, fused in ((3, None), (4, None), (7, True), (16, None)):
            check(kv, gqa, head_dim, bs, lens, [1] * len(lens), kv_heads=8, device="cuda", num_layers=2,
                  model_dtype=model, seed=splits, attend=lambda *a: decode_direct(*a, splits=splits, fused=fused))
        for splits, tail_first in ((1, True), (3, True), (3, False), (7, True)):  # the tail before or after the pages
            check(kv, gqa, head_dim, bs, lens, [1] * len(lens), kv_heads=8, device="cuda", num_layers=2,
                  model_dtype=model, seed=splits + 1,
                  attend=lambda *a: decode_direct(*a, splits=splits, tail_first=tail_first))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_gpu_direct_pool_past_65536_pages(kv):
    check(kv, 4, 128, 16, [4000, 20, 1600], [1, 1, 1], kv_heads=8, num_layers=1, layer=0, device="cuda",
          first_page=70_000, model_dtype=torch.float16,
          attend=lambda *a: decode_attention(*a, direct=True))
