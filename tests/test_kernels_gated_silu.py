"""The one-launch gated SiLU (`kernels/gated_silu.py`) against torch's silu(gate) * up on fresh random
data: the [gate | up] rows as the MLP's fused projection returns them (and as a strided view), fp32
as torch computes in fp32, fp16 / bf16 within one rounding of the fp32 result. CPU: Triton's
interpreter; GPU (marked): the compiled kernel, and the model's MLP takes it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels.gated_silu import gated_silu

ON_GPU = torch.cuda.is_available()


def _reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return F.silu(gate) * up  # [T, I] fp32


@pytest.mark.parametrize("T, inter", [(3, 40), (1, 1536), (2, 1030)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gated_silu_matches_torch(T, inter, dtype):
    dev = "cuda" if ON_GPU else "cpu"
    g = torch.Generator().manual_seed(T * inter)
    x = (4 * torch.randn(T, 2 * inter, generator=g)).to(dtype).to(dev)
    got = gated_silu(x)
    exact = _reference(x)
    assert got.shape == (T, inter) and got.is_contiguous() and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
    else:
        ulp = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
        assert ((got.float() - exact).abs() <= ulp * exact.abs() + 1e-6).all()


def test_gated_silu_reads_row_strided_views():
    dev = "cuda" if ON_GPU else "cpu"
    wide = torch.randn(4, 3 * 96, generator=torch.Generator().manual_seed(5)).to(dev)
    x = wide[:, 32:32 + 2 * 96]  # rows 288 apart, channels contiguous
    torch.testing.assert_close(gated_silu(x), _reference(x), rtol=1e-6, atol=1e-6)


def test_gated_silu_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous channels"):
        gated_silu(torch.randn(8, 4).t())


@pytest.mark.gpu
def test_gpu_model_mlp_takes_the_kernel_and_adds_in_the_gemm():
    from kvmesh.model.llama import MLP, RMSNorm
    from kvmesh.model.config import ModelConfig
    cfg = ModelConfig("LlamaForCausalLM", 64, 1, 4, 2, 16, 160, 100, 1e4, None, 1e-5, True, False,
                      256, 1, (2,), "bfloat16", "t")
    torch.manual_seed(3)
    mlp = MLP(cfg).to("cuda", torch.bfloat16)
    norm = RMSNorm(64, 1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)  # the layer's stream
    h = F.rms_norm(x.float(), (64,), norm.weight.float(), 1e-5)
    gate, up = (h @ mlp.gate_up_proj.weight.float().t()).chunk(2, dim=-1)
    want = x.float() + (F.silu(gate) * up) @ mlp.down_proj.weight.float().t()  # [5, 64] fp32
    with torch.no_grad():
        got = mlp(norm, x)
    assert got.data_ptr() == x.data_ptr()  # the GEMM added into the layer's stream in place
    assert (got.float() - want).norm() <= 2e-2 * want.norm()
