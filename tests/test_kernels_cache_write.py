"""Triton cache write against the torch quantization reference (`kvmesh.kv.quant`) and `TorchBackend.write`.

Pages must match byte for byte, data and scales, for every dtype, on the CPU (interpreter) and the GPU:
the kernel encodes fp8 with integer ops (round half-to-even), so the interpreter's faulty fp8 casts
(environment.md) play no part. The reference always runs on the CPU: on CUDA, torch turns
`tensor / python_float` (quant.py's `absmax / FMAX`) into a multiply by the reciprocal, which moves
some fp8 scales by one ulp (measured on the H200), while layout.py specifies a true division.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from kvmesh.kernels.cache_write import write_blocks
from kvmesh.kernels.metadata import SeqSlice, build_attention_metadata, pad_write_plan
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kernels.triton_backend import TritonBackend
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import STORAGE_DTYPES, KVCache
from kvmesh.kv.quant import QuantizedBlocks, int4_key_codes, quantize_blocks, store_blocks

DTYPES = ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


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
    a, b = got.pool.cpu(), want.pool.cpu()
    assert torch.equal(a, b), f"{kv}: {int((a != b).sum())} bytes differ"


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


# formats.div_rn_fma in C (fmaf rounds once, like the GPU's FFMA) against IEEE x / s. x and s run over
# significands in [1, 2): both sides scale exactly by powers of two while everything stays normal.
# argv[1] = stride over the 2**23 s significands (1: the whole domain, 2**33 pairs with fp16/bf16 x).
DIV_CHECK_C = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static float fb(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static uint32_t bf(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float div_fma(float x, float s, float inv, int steps) {
    float q = x * inv;
    for (int i = 0; i < steps; i++) q = fmaf(fmaf(q, s, -x), -inv, q);
    return q;
}
int main(int argc, char **argv) {
    uint32_t stride = (uint32_t)atoi(argv[1]);
    uint64_t st = 88172645463325252ull;
    long pairs = 0, bad1 = 0, bad2 = 0, control = 0, signs = 0;
    for (uint32_t S = 0; S < (1u << 23); S += stride) {
        float s = fb(0x3F800000u | S), inv = 1.0f / s;
        for (uint32_t X = 0; X < 1024; X++) {  /* every fp16 (and so bf16) significand: 1 step */
            float x = fb(0x3F800000u | (X << 13));
            bad1 += bf(div_fma(x, s, inv, 1)) != bf(x / s);
            control += bf(x * inv) != bf(x / s);
        }
        for (int i = 0; i < 64; i++) {  /* random fp32 significands: 2 steps */
            st ^= st << 13; st ^= st >> 7; st ^= st << 17;
            float x = fb(0x3F800000u | ((uint32_t)(st >> 20) & 0x7FFFFF));
            bad2 += bf(div_fma(x, s, inv, 2)) != bf(x / s);
        }
        float z[4] = {0.0f, -0.0f, -1e-45f, -1e-40f};  /* signed zeros and underflows keep x's sign */
        for (int i = 0; i < 4; i++) signs += !signbit(div_fma(z[i], s * 0x1p40f, inv * 0x1p-40f, 1)) != !signbit(z[i]);
        pairs += 1024;
    }
    printf("%ld %ld %ld %ld %ld\n", pairs, bad1, bad2, control, signs);
    return 0;
}
"""


def test_fma_division_matches_ieee_division(tmp_path):
    """The GPU path's division (one multiply by inv = RN(1/s), fma corrections) is bit-equal to IEEE
    division: every fp16/bf16 significand against every 257th fp32 s significand (the full run,
    stride 1, passed too), random fp32 x with 2 steps, signed zeros; bare x * inv must fail."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "div.c").write_text(DIV_CHECK_C)
    subprocess.run([cc, "-O2", "-ffp-contract=off", "-o", str(tmp_path / "div"), str(tmp_path / "div.c"), "-lm"],
                   check=True)
    out = subprocess.run([str(tmp_path / "div"), "257"], capture_output=True, text=True, check=True).stdout
    pairs, bad1, bad2, control, signs = map(int, out.split())
    assert pairs > 30_000_000 and bad1 == 0 and bad2 == 0 and signs == 0
    assert control > pairs // 10  # x * RN(1/s) alone misrounds often: the check can fail


def near_ties(kv: str, n: int, H: int, D: int, bs: int, dt: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """K/V rows [n * bs, H, D] in `dt` whose quotients x / s sit on and next to the rounding ties and
    the representable values of the format (fp8: all codes and midpoints; int8: k and k + 1/2), plus
    signed zeros and the model dtype's subnormals. s is each group's scale as quant.py computes it."""
    fmax = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}[kv]
    if kv == "int8":
        grid = torch.arange(0, 255) / 2  # [255] k / 2
    else:
        vals = torch.arange(0, 128, dtype=torch.uint8).view(STORAGE_DTYPES[kv]).float()
        vals = vals[torch.isfinite(vals)]
        grid = torch.cat([vals, (vals[1:] + vals[:-1]) / 2])
    hi = 15 if dt == torch.float16 else 40  # fp16 tops out at 65504
    x = torch.empty(n, H, bs, D)
    amax = torch.pow(2.0, torch.empty(n, H, bs if kv == "int8" else 1, 1).uniform_(-20, hi, generator=gen)).to(dt).float()
    s = torch.maximum(amax, torch.tensor(1e-6)) / torch.tensor(fmax)  # true division (see top)
    if kv == "int8":
        s = s.clamp(max=65504.0).to(torch.float16).float().clamp(min=2.0 ** -24)
    pick = grid[torch.randint(0, len(grid), x.shape, generator=gen)]
    sign = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0)
    x = (pick * s * sign).to(dt)
    bits = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}[dt]
    nudge = torch.randint(-2, 3, x.shape, generator=gen).to(bits)  # 0..2 ulps either way
    mag = (x.abs().view(bits) + nudge).clamp(min=0).view(dt)  # nudge the magnitude, keep the sign
    x = torch.where(x < 0, -mag, mag).float()
    x = torch.maximum(torch.minimum(x, amax), -amax)
    x[..., 0] = amax[..., 0]  # the group maximum is exactly amax, so s is the scale above
    special = torch.rand(x.shape, generator=gen)
    tiny = torch.finfo(dt).smallest_normal / 4 if dt != torch.float32 else 2.0 ** -130
    x = torch.where(special < 0.01, -0.0, torch.where(special < 0.02, 0.0, x))
    x = torch.where((special >= 0.02) & (special < 0.03), tiny * sign, x)
    x[..., 0] = amax[..., 0]
    return x.to(dt).transpose(1, 2).reshape(n * bs, H, D)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_hardware_paths_byte_exact_near_ties(kv, dt):
    # the GPU path's hardware fp8 cast (cvt.rn.satfinite) and fma division against the CPU
    # reference, on values built to sit on rounding ties: every byte equal
    n, H, D, bs = 64, 8, 128, 16
    gen = torch.Generator().manual_seed(11)
    k = near_ties(kv, n, H, D, bs, dt, gen)
    v = near_ties(kv, n, H, D, bs, dt, gen)
    layout = BlockLayout(num_layers=1, kv_heads=H, head_dim=D, block_size=bs, kv_dtype=kv)
    got = KVCache(layout, n, 1, dt, "cuda")
    rows = torch.arange(n * bs, device="cuda").view(n, bs) + bs  # all new rows
    write_blocks(got, 0, k.cuda(), v.cuda(), rows, torch.arange(n, device="cuda"))
    ref = KVCache(layout, n, 1, dt, "cpu")
    store_blocks(ref.layer_view(0), torch.arange(n), quantize_blocks(k.view(n, bs, H, D), v.view(n, bs, H, D), kv))
    assert_pages_match(kv, got, ref)


def int4_hard_blocks(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V fp32 [6, 16, 2, 64]: constant channels, an outlier, all-negative and far-offset blocks,
    zeros, then a block whose inner values sit on and next to the code ties of its own groups (keys
    x / s + 7.5 = k + 1/2, values (x - m) / s = k + 1/2; group ends untouched, so the reference's
    scales stay those used here). Only the keys get ties; values are covered by the random blocks."""
    n, bs, H, D = 6, 16, 2, 64
    k = torch.randn(n, bs, H, D, generator=gen) * 3
    k[0, :, :, 5] = 3.0
    k[1, 2, 0, 9] = -300.0
    k[2] = -k[2].abs() - 50.0
    k[3] = k[3] * 1e-3 + 1e3
    k[4] = 0.0
    v = torch.randn(n, bs, H, D, generator=gen)
    qb = quantize_blocks(k[5:], v[5:], "int4")
    rec = qb.k_scale[0]  # [H, 16 + D]: K header, V header, s codes
    h = rec[:, :8].contiguous().view(torch.bfloat16).float()  # [H, 4]
    s = int4_key_codes(rec).float() * h[:, 2:3]  # [H, D], channel order
    x = k[5].transpose(0, 1)  # [H, bs, D]
    ties = torch.randint(-7, 8, x.shape, generator=gen).float() * s[:, None]  # x / s + 7.5 = j + 7.5
    bits = ties.view(torch.int32) + torch.randint(-2, 3, x.shape, generator=gen, dtype=torch.int32)
    bits = torch.where(ties == 0, 0, bits)  # a zero's neighbours in bits are NaN and -0.0: 0 stays a tie
    inner = (x > x.amin(1, keepdim=True)) & (x < x.amax(1, keepdim=True))
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    k[5] = torch.where(inner, bits.view(torch.float32).clamp(lo, hi), x).transpose(0, 1)
    return k, v


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_int4_hard_blocks_byte_exact(device):
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on the CPU only under its interpreter (tests/conftest.py sets it)")
    # int4's code pairs, headers and nibbles on edge-case groups and near code ties, fp32 rows
    k, v = int4_hard_blocks(torch.Generator().manual_seed(7))
    n, bs, H, D = k.shape
    layout = BlockLayout(num_layers=1, kv_heads=H, head_dim=D, block_size=bs, kv_dtype="int4")
    got = KVCache(layout, n, 1, torch.float32, device)
    rows = torch.arange(n * bs, device=device).view(n, bs) + bs  # all new rows
    write_blocks(got, 0, k.reshape(n * bs, H, D).to(device), v.reshape(n * bs, H, D).to(device), rows,
                 torch.arange(n, device=device))
    ref = KVCache(layout, n, 1, torch.float32, "cpu")
    store_blocks(ref.layer_view(0), torch.arange(n), quantize_blocks(k, v, "int4"))
    got.pool = got.pool.cpu()
    assert_pages_match("int4", got, ref)


# the engine's residual is in the model's dtype; a widening cast is exact (the interpreter's narrowing
# fp32 -> bf16 cast truncates, where torch and the GPU round to nearest even)
@pytest.mark.parametrize("model_dtype, res_dtype, kv_heads, head_dim", [
    (torch.float16, torch.float16, 3, 64), (torch.bfloat16, torch.bfloat16, 2, 48), (torch.bfloat16, torch.float32, 5, 16)])
def test_copy_to_residual_rows(model_dtype, res_dtype, kv_heads, head_dim):
    """The leftover rows' one launch: new rows of k and v (views into a wider qkv row, as the model
    passes them) land at their residual rows of one layer in the residual's dtype; nothing else moves."""
    from kvmesh.kernels.cache_write import copy_to_residual
    layout = BlockLayout(num_layers=3, kv_heads=kv_heads, head_dim=head_dim, block_size=16, kv_dtype="int8")
    cache = KVCache(layout, 4, 5, res_dtype, DEV)
    g = torch.Generator().manual_seed(head_dim)
    cache.residual.copy_(torch.randn(cache.residual.shape, generator=g).to(res_dtype))
    before = cache.residual.clone()
    qkv = torch.randn(7, 4 * kv_heads, head_dim, generator=g).to(model_dtype).to(DEV)  # [T, q + k + v heads, D]
    k, v = qkv[:, 2 * kv_heads:3 * kv_heads], qkv[:, 3 * kv_heads:]  # strided rows, contiguous heads
    R = 5 * 16
    src = torch.tensor([R + 6, R + 0, R + 3], dtype=torch.int64, device=DEV)
    dst = torch.tensor([4 * 16 + 15, 0 * 16 + 2, 2 * 16 + 9], dtype=torch.int64, device=DEV)
    copy_to_residual(cache, 1, k, v, src, dst)
    want = before.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        want[d // 16, 1, 0, :, d % 16] = k[s - R].cpu().to(res_dtype)
        want[d // 16, 1, 1, :, d % 16] = v[s - R].cpu().to(res_dtype)
    assert torch.equal(cache.residual.cpu(), want)


@pytest.mark.parametrize("kv", DTYPES)
def test_decode_batch_write_is_one_launch(kv, monkeypatch):
    """A decode batch's paired plan (`WritePlan.paired`): the completed blocks and every row's residual
    copy in one launch, the same bytes as the torch backend's blocks-then-copies. Rows 0 and 2 complete
    a block, row 1 does not, row 3 is padding (the scratch slot); 4 KV heads so INT4 programs take
    several heads each."""
    from kvmesh.engine.decode_batch import DecodeBatch, DecodeShape
    from kvmesh.kernels import triton_backend
    layout = BlockLayout(num_layers=2, kv_heads=4, head_dim=32, block_size=16, kv_dtype=kv)
    got, want = (KVCache(layout, 12, 5, torch.float16, DEV) for _ in range(2))
    g = torch.Generator().manual_seed(len(kv))
    got.residual.copy_((torch.randn(got.residual.shape, generator=g) * 3).to(torch.float16))
    want.residual.copy_(got.residual)
    batch = DecodeBatch(DecodeShape(rows=4, table_width=4, block_size=16, num_slots=5, scratch_slot=4),
                        torch.device(DEV))
    batch.fill([1, 2, 3], [SeqSlice(15, 1, [7, 9], 2), SeqSlice(20, 1, [3, 1], 0), SeqSlice(47, 1, [5, 6, 8, 2], 1)])
    meta = batch.metadata(max_prefix_len=64)
    assert meta.write.paired and meta.write.block_ids.tolist() == [7, -1, 8, -1]
    qkv = (torch.randn(4, 3 * 4, 32, generator=g) * 3).to(torch.float16).to(DEV)  # [T, q + k + v heads, D]
    k, v = qkv[:, 4:8], qkv[:, 8:]  # strided rows, as the model passes them

    def no_second_launch(*args):
        raise AssertionError("a paired plan's residual rows take the blocks' launch")
    monkeypatch.setattr(triton_backend, "copy_to_residual", no_second_launch)
    TritonBackend().write(got, 1, k, v, meta)
    want.pool, want.residual = want.pool.cpu(), want.residual.cpu()
    cpu = batch.metadata(max_prefix_len=64)
    cpu.write = type(cpu.write)(*(t.cpu() for t in (cpu.write.block_rows, cpu.write.block_ids,
                                                     cpu.write.residual_src, cpu.write.residual_dst)))
    TorchBackend().write(want, 1, k.cpu(), v.cpu(), cpu)
    assert torch.equal(got.residual.cpu(), want.residual)
    assert_pages_match(kv, got, want)
    with pytest.raises(ValueError, match="paired plan"):
        write_blocks(got, 1, k, v, meta.write.block_rows, meta.write.block_ids,
                     residual=(meta.write.residual_src[:2], meta.write.residual_dst[:2]))
