"""The model's CPU fast paths give the same numbers as the plain ops: MKL pre-packed fp32 linears
and oneDNN pre-packed bf16 linears (`kvmesh.model.packed_linear`) at every row count (one pack
serves them all), their fused epilogues within one bf16 rounding of the unfused ops, and `RMSNorm`'s
composite path for prompt-sized fp32 inputs (bit-identical to `F.rms_norm`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.model.llama import RMSNorm
from kvmesh.model.packed_linear import (PackedBf16Linear, PackedGateUp, PackedLinear, mkl_packing_works,
                                        onednn_bf16_packing_works, pack_linears)

torch.set_num_threads(1)
needs_mkl = pytest.mark.skipif(not mkl_packing_works(), reason="this torch build has no MKL packed GEMM")
needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16_packing_works(),
                                       reason="this torch build or CPU has no oneDNN bf16 GEMM")


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(96, 64), (257, 33), (1000, 576)])
def test_packed_linear_matches_f_linear_at_any_row_count(n, k, bias):
    gen = torch.Generator().manual_seed(n * 7 + k + bias)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    lin = PackedLinear(w, b)
    for rows in (1, 2, 7, 16, 32, 33, 300):
        x = torch.randn(rows, k, generator=gen)
        got, want = lin(x), F.linear(x, w, b)
        assert got.shape == (rows, n)
        if rows >= 32:  # MKL's own kernel on both paths from here on: bit-identical
            assert torch.equal(got, want)
        # fewer rows: another MKL kernel on the plain path, fp32 rounding over k products
        torch.testing.assert_close(got, want, rtol=1e-5, atol=4e-6 * k ** 0.5)
    assert lin(torch.randn(2, 3, k, generator=gen)).shape == (2, 3, n)  # leading dims kept
    assert lin(torch.randn(0, k)).shape == (0, n)


@needs_mkl
@needs_onednn_bf16
def test_pack_linears_swaps_fp32_and_bf16_cpu_linears():
    gen = torch.Generator().manual_seed(3)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8, bias=False)),
                        nn.Linear(8, 4).to(torch.bfloat16), nn.Linear(4, 4).to(torch.float16))
    for p in net.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(5, 16, generator=gen)
    with torch.inference_mode():
        want = net[2](net[1](net[0](x)))
        want16 = net[3](want.bfloat16())
        assert pack_linears(net) == 3
        assert isinstance(net[0], PackedLinear) and isinstance(net[2][0], PackedLinear)
        assert isinstance(net[3], PackedBf16Linear)
        assert type(net[4]) is nn.Linear  # fp16: no packed GEMM, stays
        got = net[2](net[1](net[0](x)))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(net[3](want.bfloat16()), want16)


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_is_f_linear_at_any_row_count(bias):
    gen = torch.Generator().manual_seed(17 + bias)
    w = torch.randn(1000, 576, generator=gen).bfloat16()  # [N, K]
    b = torch.randn(1000, generator=gen).bfloat16() if bias else None
    lin = PackedBf16Linear(w, b)
    for rows in (1, 2, 7, 32, 33, 300):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        assert torch.equal(lin(x), F.linear(x, w, b))  # the same oneDNN kernel, its weight packed once
        other = torch.randn(rows, 1000, generator=gen).bfloat16()
        y = F.linear(x.float(), w.float(), None if b is None else b.float())  # the fp32 accumulator
        # fused epilogues: applied to the accumulator, one rounding to bf16 (unfused: two)
        for got, want in ((lin.add_to(x, other), y + other.float()), (lin.mul_by(x, other), y * other.float()),
                          (lin.silu(x), F.silu(y))):
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-2)
    assert lin(torch.randn(2, 3, 576, generator=gen).bfloat16()).shape == (2, 3, 1000)  # leading dims kept
    assert lin(torch.randn(0, 576).bfloat16()).shape == (0, 1000)


@needs_onednn_bf16
def test_packed_gate_up_is_silu_gate_times_up():
    gen = torch.Generator().manual_seed(5)
    inter = 1536
    w = (torch.randn(2 * inter, 576, generator=gen) * 0.05).bfloat16()  # [2I, K] = [gate; up]
    lin = PackedGateUp(w, inter)
    x = torch.randn(33, 576, generator=gen).bfloat16()
    gate, up = F.linear(x.float(), w.float()).split(inter, dim=-1)
    torch.testing.assert_close(lin.silu_mul(x).float(), F.silu(gate) * up, rtol=2 ** -7, atol=1e-3)
    assert torch.equal(lin(x), F.linear(x, w))  # the unfused output, for other readers
    with pytest.raises(ValueError, match="2 \\* 1536"):
        PackedGateUp(w[:100], inter)


def _amx():
    from kvmesh.kernels.cpu_native import load
    native = load()
    if native is None or not native.amx_ready():
        pytest.skip("no AMX here (or no C compiler): oneDNN serves every row count")
    return native


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_is_onednn_at_decode_row_counts(bias):
    """The C AMX kernel (rows <= AMX_MAX_ROWS) gives oneDNN's bits up to 32 rows, plain and with the
    residual add; past 32 rows (32-row chunks) each row is what it is alone, as at any row count."""
    from kvmesh.model.packed_linear import AMX_MAX_ROWS
    native = _amx()
    gen = torch.Generator().manual_seed(23 + bias)
    w = torch.randn(960, 576, generator=gen).bfloat16()
    b = torch.randn(960, generator=gen).bfloat16() if bias else None
    lin, onednn = PackedBf16Linear(w, b, native), PackedBf16Linear(w, b)
    assert lin.amx is not None and onednn.amx is None
    for rows in (1, 5, 16, 17, 32, 33, AMX_MAX_ROWS, AMX_MAX_ROWS + 1):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        other = torch.randn(rows, 960, generator=gen).bfloat16()
        got, added = lin(x), lin.add_to(x, other)
        if rows <= 32 or rows > AMX_MAX_ROWS:
            assert torch.equal(got, F.linear(x, w, b)) and torch.equal(added, onednn.add_to(x, other))
        one = torch.cat([lin(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(got, one) or rows > AMX_MAX_ROWS  # a row's result does not depend on the batch
    xt = torch.randn(8, 700, generator=gen).bfloat16()[:, :576]  # strided rows
    assert torch.equal(lin(xt), F.linear(xt, w, b))
    assert PackedBf16Linear(torch.randn(100, 576).bfloat16(), None, native).amx is None  # N % 32: oneDNN


@needs_onednn_bf16
def test_amx_gate_up_rounds_silu_as_onednn():
    native = _amx()
    gen = torch.Generator().manual_seed(6)
    inter = 1536
    w = (torch.randn(2 * inter, 576, generator=gen) * 0.05).bfloat16()
    lin = PackedGateUp(w, inter, native)
    assert lin.amx is not None
    for rows in (1, 20, 32, 64):
        x = (torch.randn(rows, 576, generator=gen) * 4).bfloat16()
        want = lin.up.mul_by(x, lin.gate.silu(x))  # oneDNN: silu(gate) rounded to bf16, times up
        # only silu's float32 approximations differ, then both round: within one bf16 step
        torch.testing.assert_close(lin.silu_mul(x).float(), want.float(), rtol=2 ** -7, atol=1e-3)


def test_packed_linears_reject_other_weight_dtypes():
    with pytest.raises(ValueError, match="float32"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="bfloat16"):
        PackedBf16Linear(torch.zeros(4, 4), None)


@pytest.mark.parametrize("rows", [1, 63, 64, 2048])
def test_rms_norm_prompt_path_is_bit_identical(rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.copy_(torch.randn(576, generator=gen))
    for scale in (1e-3, 1.0, 50.0):
        x = torch.randn(rows, 576, generator=gen) * scale
        assert torch.equal(norm(x), F.rms_norm(x, (576,), norm.weight, 1e-5))
