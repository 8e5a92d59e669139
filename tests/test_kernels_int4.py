"""INT4 kernels against the torch references: the cache write (`write_blocks`, byte-exact against
`quant.quantize_blocks`) over its heads-per-program and warp variants, and the scales-folded decode
(`decode_int4`) against `TorchBackend.attend` on the same dequantized cache.

CPU: Triton's interpreter at small shapes (GQA 1/4/8, head_dim 64/128, block 16/32, ragged contexts
with empty, residual-only, exact-page and page + tail prefixes, random page order, page 0 unused,
forced splits including more splits than a sequence has pages, 1/2/4 page streams). Fresh random
data per case. Tolerance: relative L2 <= 2e-3 (int4's budget in the issue); the decode's own error
is ~1e-3 of that (fp16 rounding of q * s and p * s), the codes themselves are exact.
GPU (`-m gpu`): a pool past 65,536 pages (byte offsets above 2**32) at Llama-3-8B heads; the
register-direct kernel (`decode_int4_direct`, fp16 and bf16 models) over the same grid, with fused
and second-launch split reductions, queries from 10**-3 to 3,000 (the kernel scales q by a power of
two), and `decode_attention`'s dispatch to it.
"""
from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.cache_write import int4_heads, write_blocks
from kvmesh.kernels.decode_int4 import decode_int4
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.kv.quant import quantize_blocks, store_blocks

from test_kernels_attention import make_case, rel_l2

TOL = 2e-3


F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@pytest.mark.parametrize("kv_heads,head_dim,bs,warps,hp,src_dtype", [
    (8, 128, 16, 1, 2, F16), (8, 128, 16, 1, None, F32), (8, 64, 32, 1, 4, BF16), (8, 128, 32, 2, 4, F16),
    (8, 64, 16, 4, 8, F16), (4, 32, 16, 1, 2, F32),  # head_dim 32: one group a token, V codes as bytes
])
def test_write_variants_byte_exact(kv_heads, head_dim, bs, warps, hp, src_dtype):
    # residual and new rows mixed, a -1 block, every variant of heads per program
    g = torch.Generator().manual_seed(kv_heads * head_dim + bs + (hp or 0))
    layout = BlockLayout(num_layers=2, kv_heads=kv_heads, head_dim=head_dim, block_size=bs, kv_dtype="int4")
    got = KVCache(layout, 6, 2, src_dtype, "cpu")
    got.residual.copy_((torch.randn(got.residual.shape, generator=g) * 2).to(src_dtype))
    want = KVCache(layout, 6, 2, src_dtype, "cpu")
    T = 2 * bs
    k = (torch.randn(T, kv_heads, head_dim, generator=g) * 4 + torch.randn(head_dim, generator=g)).to(src_dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(src_dtype)
    R = got.num_residual_slots * bs
    rows = torch.randperm(R + T, generator=g)[:2 * bs].view(2, bs)
    write_blocks(got, 1, k, v, rows, torch.tensor([4, -1]), num_warps=warps, heads_per_program=hp)  # -1 skipped
    write_blocks(got, 0, k, v, rows, torch.tensor([4, 1]), num_warps=warps, heads_per_program=hp)
    for layer, n in ((1, 1), (0, 2)):
        S_k = torch.cat([got.residual[:, layer, 0].transpose(1, 2).reshape(R, kv_heads, head_dim), k])  # rows of S
        S_v = torch.cat([got.residual[:, layer, 1].transpose(1, 2).reshape(R, kv_heads, head_dim), v])
        store_blocks(want.layer_view(layer), torch.tensor([4, 1][:n]),
                     quantize_blocks(S_k[rows[:n]], S_v[rows[:n]], "int4"))
    assert torch.equal(got.pool, want.pool), f"{int((got.pool != want.pool).sum())} bytes differ"


def test_int4_heads_per_program():
    assert int4_heads(8, 128, 1) == 2  # 256 channels: 8 per thread of one warp
    assert int4_heads(8, 64, 1) == 4
    assert int4_heads(8, 128, 4) == 8
    assert int4_heads(8, 128, 1, elem_bytes=4) == 1  # fp32 rows: 4 channels a 16-byte load
    assert int4_heads(2, 64, 1) == 2  # capped by the KV heads
    assert int4_heads(3, 64, 1) == 1


def check_decode(gqa, head_dim, bs, prefix_lens, seed, case=None, decode=decode_int4, **kw) -> float:
    """`decode` (options kw) vs TorchBackend on a fresh make_case cache (options case)."""
    case = case or {}
    cache, meta, q, k, v = make_case("int4", gqa, head_dim, bs, prefix_lens, [1] * len(prefix_lens), seed=seed,
                                     **case)
    layer = case.get("layer", 1)
    scale = head_dim ** -0.5
    ref = TorchBackend().attend(cache, layer, q, k, v, meta, scale)
    out = decode(cache, layer, q, k, v, meta, scale, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = rel_l2(out, ref)
    assert err <= TOL, f"gqa={gqa} D={head_dim} bs={bs} {kw}: relative L2 {err:.2e} > {TOL}"
    return err


@pytest.mark.parametrize("gqa,head_dim,bs", [(1, 64, 16), (4, 128, 32), (8, 64, 32), (4, 128, 16), (3, 64, 16)])
def test_decode_int4_matches_torch(gqa, head_dim, bs):
    # empty prefix, residual only, exact pages, pages + tail, a longer one crossing several tiles
    check_decode(gqa, head_dim, bs, [0, bs - 3, 2 * bs, 3 * bs + 5, 9 * bs + 1], seed=gqa + head_dim + bs)


@pytest.mark.parametrize("splits,pages", [(2, 1), (3, 2), (5, 4), (1, 1), (1, 2)])
def test_decode_int4_splits_and_streams(splits, pages):
    # more splits than some sequences have pages: empty splits drop out of the reduction
    check_decode(4, 64, 16, [5, 16, 4 * 16 + 1, 11 * 16 + 7], seed=splits * 10 + pages, splits=splits, pages=pages)


@pytest.mark.gpu
@pytest.mark.parametrize("gqa,head_dim,bs", [(4, 128, 16), (1, 128, 16), (8, 64, 32)])
def test_gpu_decode_int4(gqa, head_dim, bs):
    lens = [0, 17, 1000, 3000, 64, 2049, 511, 129]
    on_gpu = dict(kv_heads=8, device="cuda")
    check_decode(gqa, head_dim, bs, lens, seed=1, case=on_gpu)
    check_decode(gqa, head_dim, bs, lens, seed=2, case=on_gpu, splits=7)
    # pages >= 70,000 of a one-layer pool: page * page_bytes passes 2**32
    check_decode(gqa, head_dim, bs, [4000, 20, 1600], seed=3,
                 case=dict(on_gpu, first_page=70_000, num_layers=1, layer=0))


@pytest.mark.gpu
@pytest.mark.parametrize("gqa,head_dim,bs,dtype", [(4, 128, 16, F16), (1, 128, 16, F16), (8, 64, 32, F16),
                                                   (3, 64, 16, F16), (4, 128, 32, BF16), (4, 256, 16, F16),
                                                   (8, 128, 16, BF16), (16, 128, 16, F16), (12, 64, 32, BF16)])
def test_gpu_decode_int4_direct(gqa, head_dim, bs, dtype):
    """Every path of the direct kernel against the torch reference; G 12 and 16 take two MMA n-tiles."""
    from kvmesh.kernels.decode_int4_direct import decode_int4_direct

    lens = [0, 17, 1000, 3000, 64, 2049, 511, 129]
    on_gpu = dict(kv_heads=8, device="cuda", model_dtype=dtype)
    check_decode(gqa, head_dim, bs, lens, seed=1, case=on_gpu, decode=decode_int4_direct)
    check_decode(gqa, head_dim, bs, lens, seed=2, case=on_gpu, decode=decode_int4_direct, splits=3)  # fused
    check_decode(gqa, head_dim, bs, lens, seed=3, case=on_gpu, decode=decode_int4_direct, splits=7)  # 2 launches
    for splits, tail_first in ((1, True), (3, True), (3, False), (7, True)):  # the tail before or after the pages
        check_decode(gqa, head_dim, bs, lens, seed=5 + splits, case=on_gpu, decode=decode_int4_direct, splits=splits,
                     tail_first=tail_first)
    check_decode(gqa, head_dim, bs, [4000, 20, 1600], seed=4, decode=decode_int4_direct,
                 case=dict(on_gpu, first_page=70_000, num_layers=1, layer=0))
    if head_dim == 128 and gqa <= 8:  # the cp.async ring serves these; its register loads stay checked
        check_decode(gqa, head_dim, bs, lens, seed=9, case=on_gpu, decode=decode_int4_direct, ring=0)
        check_decode(gqa, head_dim, bs, lens, seed=10, case=on_gpu, decode=decode_int4_direct, ring=0, splits=3)


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [1e-3, 37.0, 3000.0])
def test_gpu_decode_int4_direct_query_range(q_scale):
    """The direct kernel takes q to a power of two near 2**14 (so q times a K code, an fp16
    subnormal, stays a normal number): tiny and large queries, the softmax scale divided by the same
    factor, so the attention itself is the usual one."""
    from kvmesh.kernels.decode_int4_direct import decode_int4_direct

    lens = [0, 17, 1000, 2049, 129]
    cache, meta, q, k, v = make_case("int4", 4, 128, 16, lens, [1] * len(lens), seed=8, kv_heads=8, device="cuda",
                                     model_dtype=F16)
    q = (q.float() * q_scale).half()
    scale = 128 ** -0.5 / q_scale
    ref = TorchBackend().attend(cache, 1, q, k, v, meta, scale)
    for splits in (None, 3):
        err = rel_l2(decode_int4_direct(cache, 1, q, k, v, meta, scale, splits=splits), ref)
        assert err <= TOL, f"q x {q_scale}, splits {splits}: relative L2 {err:.2e} > {TOL}"


@pytest.mark.gpu
def test_gpu_decode_attention_sends_int4_to_direct():
    from kvmesh.kernels.decode_attention import decode_attention

    for direct in (None, True, False):  # direct kernel, required, tile kernel
        check_decode(4, 128, 16, [0, 33, 700], seed=5, decode=decode_attention, direct=direct,
                     case=dict(kv_heads=8, device="cuda", model_dtype=F16))
    with pytest.raises(ValueError, match="does not serve"):  # fp32 models: only the tile kernel
        check_decode(4, 128, 16, [33], seed=6, decode=decode_attention, direct=True,
                     case=dict(kv_heads=8, device="cuda"))
