"""The C decode attention kernel (`kvmesh.kernels.cpu_native`) against `TorchBackend`'s pure-torch
path, on fresh random caches: fp32 and bf16 pages, prefixes from 0 to several pages (block
boundaries included), padded block tables, shuffled residual slots and pages, mixed steps where
only some sequences decode, and the same engine greedy tokens with and without it."""
from __future__ import annotations

import ctypes

import pytest
import torch

from kvmesh.kernels.cpu_native import NativeKernels, _build, load
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache

torch.set_num_threads(1)
native = load()
pytestmark = pytest.mark.skipif(native is None, reason="no C compiler: the native kernel could not be built")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _kernels(portable: bool) -> NativeKernels:
    return NativeKernels(ctypes.CDLL(str(_build())), portable=True) if portable else native


def _cache(kv: str, gen: torch.Generator, kvh: int, d: int, bs: int, blocks: int = 64) -> KVCache:
    cache = KVCache(BlockLayout(3, kvh, d, bs, kv), blocks, 12, DTYPES[kv])
    cache.residual.copy_(torch.randn(cache.residual.shape, generator=gen))
    for layer in range(3):
        view = cache.layer_view(layer)
        view.k.copy_(torch.randn(view.k.shape, generator=gen) * 2)
        view.v.copy_(torch.randn(view.v.shape, generator=gen))
    return cache


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
@pytest.mark.parametrize("heads,kvh,d,bs", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 16, 16), (8, 2, 128, 16),
                                            (5, 1, 32, 8), (4, 4, 64, 16)])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("portable", [False, True])
def test_native_decode_matches_torch_path(kv, heads, kvh, d, bs, mixed, portable):
    """Both C kernels: the AVX-512 one (head_dim 32 / 64 / 128 on CPUs that have it; 1 to 5 query
    heads a group, in chunks of up to 4, or 2 at head_dim 128) and the portable one."""
    kernels = _kernels(portable)
    gen = torch.Generator().manual_seed(heads * 31 + d + bs + mixed)
    cache = _cache(kv, gen, kvh, d, bs)
    pages = torch.randperm(64, generator=gen).tolist()
    prefixes = [0, 1, bs - 1, bs, bs + 1, 3 * bs, 5 * bs + 7, 2 * bs + 3]
    slots = torch.randperm(12, generator=gen).tolist()
    seqs, used = [], 0
    for i, p in enumerate(prefixes):
        n = 5 if mixed and i in (2, 5) else 1  # a prompt chunk among the decoding sequences
        nb = (p + n) // bs + 1
        seqs.append(SeqSlice(prefix_len=p, num_new=n, block_table=pages[used:used + nb], residual_slot=slots[i]))
        used += nb
    meta = build_attention_metadata(seqs, cache.layout, cache.num_residual_slots, "cpu")
    T = int(meta.query_start_loc[-1])
    dt = DTYPES[kv]
    qkv = torch.randn(T, heads + 2 * kvh, d, generator=gen).to(dt)  # strided token rows, as in the model
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kvh], qkv[:, heads + kvh:]
    ref = TorchBackend().attend(cache, 1, q, k, v, meta, d ** -0.5)
    got = TorchBackend(kernels).attend(cache, 1, q, k, v, meta, d ** -0.5)
    assert got.dtype == dt and got.shape == (T, heads, d)
    if kv == "fp32":  # float32 sums in another order: at head_dim 128 ~1e-6 apart on values ~0.02 (AVX2 host)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    else:  # both round float32 values that differ by summation order: at most one bf16 step apart
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=1e-3)


def test_native_decode_scope_and_checks():
    assert NativeKernels.supports(torch.bfloat16, torch.bfloat16) and NativeKernels.supports(torch.float32, torch.float32)
    assert not NativeKernels.supports(torch.bfloat16, torch.float8_e4m3fn)  # quantized pages: torch path
    assert not NativeKernels.supports(torch.float16, torch.float16)
    gen = torch.Generator().manual_seed(1)
    cache = _cache("fp32", gen, 2, 16, 8)
    view = cache.layer_view(0)
    q, kv = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    i1 = torch.zeros(1, dtype=torch.int64)
    res = cache.residual[:, 0]
    with pytest.raises(ValueError, match="strides"):  # [KVH, bs, D] rows must be dense
        native.attend(q, kv, kv, view.k.transpose(2, 3), view.v, i1.view(1, 1), i1, res[:, 0], res[:, 1], i1, i1, 0.25)
    with pytest.raises(ValueError, match="int64"):
        native.attend(q, kv, kv, view.k, view.v, i1.view(1, 1).int(), i1, res[:, 0], res[:, 1], i1, i1, 0.25)


def test_native_decode_off_by_env(monkeypatch):
    monkeypatch.setenv("KVMESH_NATIVE_DECODE", "0")
    assert load.__wrapped__() is None


@pytest.mark.parametrize("rows", [1, 33, 2048])
@pytest.mark.parametrize("dim", [576, 200])  # 200: not a multiple of 16, the AVX-512 kernel hands it on
@pytest.mark.parametrize("portable", [False, True])
def test_native_rms_norm_matches_torch_rms_norm(rows, dim, portable):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 700, generator=gen) * 3).bfloat16()[:, :dim]  # rows 700 apart
    w = (torch.rand(dim, generator=gen) * 2).bfloat16()
    got = _kernels(portable).rms_norm(x, w, 1e-5)
    want = torch.nn.functional.rms_norm(x.float(), (dim,), w.float(), 1e-5)  # float32 inside, as ours
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-6)  # one rounding to bf16
    with pytest.raises(ValueError, match="bf16"):
        native.rms_norm(x.float(), w, 1e-5)


@pytest.mark.parametrize("d", [64, 128, 16])  # 16: a half of 8, the AVX-512 kernel hands it on
@pytest.mark.parametrize("portable", [False, True])
def test_native_rope_matches_rotary_embedding(d, portable):
    from kvmesh.model.rope import RotaryEmbedding
    gen = torch.Generator().manual_seed(4)
    rope = RotaryEmbedding(d, 10000.0, None)
    cos, sin = rope.cos_sin(torch.tensor([0, 1, 5, 77, 1000, 4095]), torch.bfloat16)  # [T, 1, D]
    qkv = (torch.randn(6, 15, d, generator=gen) * 2).bfloat16()  # [T, H + 2 KVH, D]
    x = qkv[:, :12]  # rows 15 heads apart, as the model passes q and k
    got = _kernels(portable).rope(x, cos, sin)
    want = RotaryEmbedding.apply(x.float(), cos.float(), sin.float())  # float32 inside, as ours
    assert got.shape == (6, 12, d) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-6)  # one rounding to bf16
    with pytest.raises(ValueError, match="dense heads"):
        native.rope(x.transpose(0, 1), cos, sin)


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_native_residual_write_matches_torch_path(kv):
    """Decode steps (every row stays in the residual) and a step that completes blocks (the torch
    path gathers, the C copy writes the rest), k and v with different row strides as in the model."""
    gen = torch.Generator().manual_seed(7)
    bs, kvh, d = 8, 2, 16
    caches = [_cache(kv, gen, kvh, d, bs) for _ in range(2)]
    caches[1].residual.copy_(caches[0].residual)
    caches[1].pool.copy_(caches[0].pool)
    for prefixes in ([3, 0, 9, 14], [7, 15, 2, 23]):  # second: two sequences complete a block
        seqs = [SeqSlice(prefix_len=p, num_new=1, block_table=[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3],
                         residual_slot=11 - i) for i, p in enumerate(prefixes)]
        meta = build_attention_metadata(seqs, caches[0].layout, 12, "cpu")
        qk = torch.randn(4, 3 * kvh, d, generator=gen).to(DTYPES[kv])
        qkv = torch.randn(4, 5 * kvh, d, generator=gen).to(DTYPES[kv])
        k, v = qk[:, kvh:2 * kvh], qkv[:, 2 * kvh:3 * kvh]  # rows 3 * kvh and 5 * kvh heads apart
        for cache, backend in zip(caches, (TorchBackend(), TorchBackend(native))):
            for layer in range(3):
                backend.write(cache, layer, k, v, meta)
        assert torch.equal(caches[0].residual, caches[1].residual)
        assert torch.equal(caches[0].pool, caches[1].pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("n", [49152, 1000, 7])  # 1000, 7: tails past the last 16 values
def test_native_argmax_matches_torch_max(dtype, portable, n):
    """First index among equal maxima (bf16 rows tie often), a NaN counting as the maximum, rows
    with a stride, as `torch.max(x, -1).indices`."""
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(9, n + 5, generator=gen) * 4).to(dtype)[:, :n]  # rows n + 5 apart
    x[1, n // 3] = x[1, n - 1] = x[1].max() + 1  # a tie: the first wins
    x[2] = -1.0  # all equal
    x[3, n // 2] = float("nan")
    x[4, 0], x[4, n - 1] = float("nan"), float("inf")
    x[5, n - 1] = float("inf")  # maximum in the tail
    x[6] = float("-inf")
    got = _kernels(portable).argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, torch.max(x, dim=-1).indices)
    assert _kernels(portable).argmax(x.half()) is None  # other dtypes: the caller runs torch
