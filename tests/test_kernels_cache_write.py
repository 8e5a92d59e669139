"""Triton cache write against the torch quantization reference (`kvmesh.kv.quant`) and `TorchBackend.write`.

Pages must match byte for byte, data and scales, for every dtype, on the CPU (interpreter) and the GPU:
the kernel encodes fp8 with integer ops (round half-to-even), so the interpreter's faulty fp8 casts
(environment.md) play no part. The reference always runs on the CPU: on CUDA, torch turns
`tensor / python_float` (quant.py's `absmax / FMAX`) into a multiply by the reciprocal, which moves
some fp8 scales by one ulp (measured on the H200), while layout.py specifies a true division.
"""
from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.cache_write import write_blocks
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata, pad_write_plan
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kernels.triton_backend import TritonBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache
from kvmesh.kv.quant import QuantizedBlocks, quantize_blocks, store_blocks

DTYPES = ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
ON_GPU = torch.cuda.is_available()


def pair_of_caches(kv: str, head_dim: int, bs: int, n_pages: int, model_dtype: torch.dtype,
                   device: str, seed: int) -> tuple[KVCache, KVCache]:
    layout = BlockLayout(num_layers=3, kv_heads=2, head_dim=head_dim, block_size=bs, kv_dtype=kv)
    a = KVCache(layout, n_pages, 3, model_dtype, device)
    g = torch.Generator().manual_seed(seed)
    a.residual.copy_((torch.randn(a.residual.shape, generator=g) * 4).to(model_dtype))
    b = KVCache(layout, n_pages, 3, model_dtype, device)
    b.residual.copy_(a.residual)
    return a, b


def cpu_quantized(k: torch.Tensor, v: torch.Tensor, kv: str) -> QuantizedBlocks:
    """`quantize_blocks` computed on the CPU (true division, as layout.py says), moved back."""
    qb = quantize_blocks(k.cpu(), v.cpu(), kv)
    dev = k.device
    return QuantizedBlocks(qb.k.to(dev), qb.v.to(dev), None if qb.k_scale is None else qb.k_scale.to(dev),
                           None if qb.v_scale is None else qb.v_scale.to(dev))


def assert_pages_match(kv: str, got: KVCache, want: KVCache) -> None:
    assert torch.equal(got.pool, want.pool), f"{kv}: {int((got.pool != want.pool).sum())} bytes differ"


@pytest.mark.parametrize("kv", DTYPES)
@pytest.mark.parametrize("head_dim,bs", [(64, 16), (128, 32)])
def test_write_blocks_matches_quant(kv, head_dim, bs):
    model_dtype = torch.float16 if kv != "bf16" else torch.bfloat16
    got, want = pair_of_caches(kv, head_dim, bs, 9, model_dtype, "cuda" if ON_GPU else "cpu", seed=bs)
    g = torch.Generator().manual_seed(head_dim)
    T = 3 * bs
    k = (torch.randn(T, 2, head_dim, generator=g) * 5).to(got.pool.device, model_dtype)
    v = torch.randn(T, 2, head_dim, generator=g).to(got.pool.device, model_dtype)
    R = got.num_residual_slots * bs
    rows = torch.randperm(R + T, generator=g)[:3 * bs].view(3, bs).to(got.pool.device)  # mixes both sources
    ids = torch.tensor([7, -1, 2], device=got.pool.device)  # -1: padding, skipped
    write_blocks(got, 1, k, v, rows, ids)

    S_k = torch.cat([got.residual[:, 1, 0].transpose(1, 2).reshape(R, 2, head_dim), k])  # rows of S
    S_v = torch.cat([got.residual[:, 1, 1].transpose(1, 2).reshape(R, 2, head_dim), v])
    keep = ids >= 0
    store_blocks(want.layer_view(1), ids[keep], cpu_quantized(S_k[rows[keep]], S_v[rows[keep]], kv))
    assert_pages_match(kv, got, want)
    assert (got.pool[[0, 1, 3, 4, 5, 6, 8]] == 0).all()  # nothing else written (incl. the -1 block)


@pytest.mark.parametrize("kv", ["fp16", "int8", "int4", "fp8_e5m2"])
def test_backend_write_matches_torch_backend(kv):
    # a real step: two prefills completing blocks from residual + new rows, a decode completing one,
    # padded with -1 blocks as a CUDA-graph runner would
    dev = "cuda" if ON_GPU else "cpu"
    got, want = pair_of_caches(kv, 64, 16, 12, torch.float16, dev, seed=3)
    seqs = [SeqSlice(5, 30, [3, 9, 4], 0), SeqSlice(0, 16, [6], 2), SeqSlice(15, 1, [1], 1)]
    meta = build_attention_metadata(seqs, got.layout, got.num_residual_slots, dev)
    meta.write = pad_write_plan(meta.write, 7)
    g = torch.Generator().manual_seed(5)
    T = 47
    k = torch.randn(T, 2, 64, generator=g).to(dev, torch.float16)
    v = torch.randn(T, 2, 64, generator=g).to(dev, torch.float16)
    TritonBackend().write(got, 2, k, v, meta)
    want.pool, want.residual = want.pool.cpu(), want.residual.cpu()  # reference on the CPU (see top)
    meta_cpu = build_attention_metadata(seqs, got.layout, got.num_residual_slots, "cpu")
    meta_cpu.write = pad_write_plan(meta_cpu.write, 7)
    TorchBackend().write(want, 2, k.cpu(), v.cpu(), meta_cpu)
    got.pool, got.residual = got.pool.cpu(), got.residual.cpu()
    assert torch.equal(got.residual, want.residual)
    assert_pages_match(kv, got, want)


def test_write_rejects_bad_rows():
    got, _ = pair_of_caches("int8", 64, 16, 4, torch.float16, "cpu", seed=0)
    k = torch.randn(16, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="block_rows must be"):
        write_blocks(got, 0, k, k, torch.zeros(1, 8, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(ValueError, match="k must be"):
        write_blocks(got, 0, k[:, :1], k, torch.zeros(1, 16, dtype=torch.int64), torch.tensor([0]))


@pytest.mark.gpu
@pytest.mark.parametrize("kv", DTYPES)
def test_gpu_write_large_pool_exact(kv):
    # pages past 65,536 at real head counts: byte offsets above 2**32, every byte exact on the GPU
    layout = BlockLayout(num_layers=1, kv_heads=8, head_dim=128, block_size=16, kv_dtype=kv)
    n_pages = 70_016
    dt = torch.bfloat16 if kv == "bf16" else torch.float16
    got = KVCache(layout, n_pages, 1, dt, "cuda")
    k = torch.randn(256 * 16, 8, 128, device="cuda").mul(4).to(dt)
    v = torch.randn(256 * 16, 8, 128, device="cuda").to(dt)
    rows = torch.arange(256 * 16, device="cuda").view(256, 16) + 16
    ids = torch.arange(n_pages - 256, n_pages, device="cuda")
    write_blocks(got, 0, k, v, rows, ids)
    ref = KVCache(layout, 256, 1, dt, "cpu")  # reference pages built entirely on the CPU (see top)
    store_blocks(ref.layer_view(0), torch.arange(256),
                 quantize_blocks(k.view(256, 16, 8, 128).cpu(), v.view(256, 16, 8, 128).cpu(), kv))
    assert torch.equal(got.pool[-256:].cpu(), ref.pool)
    assert (got.pool[:-256] == 0).all()
