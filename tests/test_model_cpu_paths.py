"""The model's CPU fast paths give the same numbers as the plain ops: MKL pre-packed fp32 linears
(`kvmesh.model.packed_linear`) at every row count (one pack serves them all), and `RMSNorm`'s
composite path for prompt-sized fp32 inputs (bit-identical to `F.rms_norm`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.model.llama import RMSNorm
from kvmesh.model.packed_linear import PackedLinear, mkl_packing_works, pack_linears

torch.set_num_threads(1)
needs_mkl = pytest.mark.skipif(not mkl_packing_works(), reason="this torch build has no MKL packed GEMM")


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
def test_pack_linears_swaps_only_fp32_cpu_linears():
    gen = torch.Generator().manual_seed(3)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8, bias=False)),
                        nn.Linear(8, 4).to(torch.bfloat16))
    for p in net.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(5, 16, generator=gen)
    with torch.inference_mode():
        want = net[2](net[1](net[0](x)))
        assert pack_linears(net) == 2
        assert isinstance(net[0], PackedLinear) and isinstance(net[2][0], PackedLinear)
        assert type(net[3]) is nn.Linear  # bf16 stays
        torch.testing.assert_close(net[2](net[1](net[0](x))), want, rtol=1e-5, atol=1e-5)


def test_packed_linear_rejects_non_fp32_weight():
    with pytest.raises(ValueError, match="float32"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.bfloat16), None)


@pytest.mark.parametrize("rows", [1, 63, 64, 2048])
def test_rms_norm_prompt_path_is_bit_identical(rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.copy_(torch.randn(576, generator=gen))
    for scale in (1e-3, 1.0, 50.0):
        x = torch.randn(rows, 576, generator=gen) * scale
        assert torch.equal(norm(x), F.rms_norm(x, (576,), norm.weight, 1e-5))
