"""The fused RMSNorm + linear + activation kernels (`kernels/norm_linear.py`) against torch on fresh
random data. The reference (float64) takes the kernel's rounding points: x times the norm's weight
rounded to the model dtype, the GEMM scaled by the rows' 1 / rms, RoPE / SiLU, one rounding at the
end (keys with centers: rounded, centered, rounded). The kernel must match it within one rounding
of the dtype, and the unfused model path (F.rms_norm, F.linear, then RoPE / SiLU, each rounded)
within a few. CPU: Triton's interpreter at small shapes; GPU (marked): SmolLM2-135M's, SmolLM2-1.7B's
and Qwen2-1.5B's shapes at decode batch sizes, every tile shape the launcher picks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels.norm_linear import MAX_HIDDEN, MAX_ROWS, ROPE, SILU, Tiles, norm_gate_up, norm_qkv_rope, takes
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.model.key_centers import centers_keys
from kvmesh.model.rope import RotaryEmbedding
from test_kernels_model import generate, tiny_model

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
ULP = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def _norm_matmul(x, norm_w, eps, w):
    """rms_norm(x) @ w^T as the kernel computes it, in float64: [T, N]."""
    xd = x.double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)  # [T, 1]
    return ((x.float() * norm_w.float()).to(x.dtype).double() @ w.double().t()) * rstd


def _qkv_reference(x, norm_w, eps, w, b, cos, sin, H, KVH, center):
    T = x.shape[0]
    acc = _norm_matmul(x, norm_w, eps, w)  # [T, (H + 2 KVH) D]
    if b is not None:
        acc = acc + b.double()
    acc = acc.view(T, H + 2 * KVH, -1)
    qk = RotaryEmbedding.rotate(acc[:, :H + KVH], cos.double(), sin.double())
    if center is not None:
        qk[:, H:] = qk[:, H:].to(x.dtype).double() - center.double()
    return torch.cat([qk, acc[:, H + KVH:]], dim=1)  # [T, H + 2 KVH, D] float64


def _unfused_qkv(x, norm_w, eps, w, b, cos, sin, H, KVH, center):
    T = x.shape[0]
    qkv = F.linear(F.rms_norm(x, norm_w.shape, norm_w, eps), w, b).view(T, H + 2 * KVH, -1)
    qk = RotaryEmbedding.rotate(qkv[:, :H + KVH], cos, sin)
    if center is not None:
        qk[:, H:] -= center
    return torch.cat([qk, qkv[:, H + KVH:]], dim=1)


def _qkv_case(T, K, H, KVH, D, dtype, bias, centered, seed):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(T, K, generator=g)).to(dtype).to(DEV)
    norm_w = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype).to(DEV)
    w = (torch.randn((H + 2 * KVH) * D, K, generator=g) / K ** 0.5).to(dtype).to(DEV)
    b = (0.5 * torch.randn((H + 2 * KVH) * D, generator=g)).to(dtype).to(DEV) if bias else None
    center = (0.2 * torch.randn(KVH, D, generator=g)).to(dtype).to(DEV) if centered else None
    positions = torch.randint(0, 8192, (T,), generator=g).to(DEV)
    cos, sin = RotaryEmbedding(D, 10000.0, None).cos_sin(positions, dtype)
    return x, norm_w, 1e-5, w, b, cos, sin, H, KVH, center


def _check(got, exact, unfused, dtype, ulps):
    ulp = ULP[dtype]
    assert got.dtype == dtype and got.shape == exact.shape
    err = (got.double() - exact).abs()
    # one rounding, and for values near zero one ulp at the tensor's typical size: the tensor cores'
    # fp32 sums (H200) moved such values by up to 0.5 ulp of it at K 576-2,048, where a wrong
    # rotation, norm or activation moves them by its whole size
    bound = ulps * ulp * exact.abs() + ulp * exact.pow(2).mean().sqrt()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    rel = (got.double() - unfused.double()).norm() / unfused.double().norm()
    assert rel <= 4 * ulp, f"relative L2 against the unfused path {rel.item():.3g}"


@pytest.mark.parametrize("T, K, H, KVH, D", [(5, 96, 9, 3, 64), (1, 64, 4, 1, 128), (20, 160, 2, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias, centered", [(False, False), (True, True)])
def test_norm_qkv_rope_matches_torch(T, K, H, KVH, D, dtype, bias, centered):
    case = _qkv_case(T, K, H, KVH, D, dtype, bias, centered, seed=T * K + H)
    got = norm_qkv_rope(*case)
    _check(got, _qkv_reference(*case), _unfused_qkv(*case), dtype, ulps=2 if centered else 1)


@pytest.mark.parametrize("tiles", [Tiles(bm=16, bn=16), Tiles(bm=64, bn=32, bk=32), Tiles(bm=32, bn=16, bk=128)])
def test_norm_qkv_rope_every_tile_shape(tiles):
    """Rows and the reduction past their tiles (T 40, K 96), a head's half in one or two tiles."""
    case = _qkv_case(40, 96, 3, 1, 64, torch.bfloat16, True, False, seed=7)
    got = norm_qkv_rope(*case, tiles=tiles)
    _check(got, _qkv_reference(*case), _unfused_qkv(*case), torch.bfloat16, ulps=1)


def _gate_up_case(T, K, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(T, K, generator=g)).to(dtype).to(DEV)
    norm_w = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype).to(DEV)
    w = (torch.randn(2 * inter, K, generator=g) / K ** 0.5).to(dtype).to(DEV)
    return x, norm_w, 1e-6, w


def _gate_up_reference(x, norm_w, eps, w):
    gate, up = _norm_matmul(x, norm_w, eps, w).chunk(2, dim=-1)
    return F.silu(gate) * up


def _unfused_gate_up(x, norm_w, eps, w):
    gate, up = F.linear(F.rms_norm(x, norm_w.shape, norm_w, eps), w).chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("T, K, inter", [(3, 96, 80), (1, 64, 32), (33, 128, 48)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_gate_up_matches_torch(T, K, inter, dtype):
    case = _gate_up_case(T, K, inter, dtype, seed=T + K + inter)
    got = norm_gate_up(*case)
    _check(got, _gate_up_reference(*case), _unfused_gate_up(*case), dtype, ulps=1)


def test_norm_linear_refuses_what_it_cannot_serve():
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(2 * 64, 64, dtype=torch.bfloat16, device=DEV)
    assert takes(x, w, ROPE) and takes(x, w, SILU)
    assert not takes(x.float(), w.float(), ROPE)  # fp32 models take the unfused path
    for epilogue in (ROPE, SILU):  # batches past those measured faster fused
        rows = MAX_ROWS[epilogue]
        assert takes(torch.randn(rows, 64, dtype=torch.bfloat16, device=DEV), w, epilogue)
        assert not takes(torch.randn(rows + 1, 64, dtype=torch.bfloat16, device=DEV), w, epilogue)
    assert not takes(x, w[:, :32], ROPE)
    wide = torch.randn(4, 2 * MAX_HIDDEN, dtype=torch.bfloat16, device=DEV)  # a reduction for cuBLAS
    assert not takes(wide, torch.empty(8, 2 * MAX_HIDDEN, dtype=torch.bfloat16, device=DEV), SILU)
    with pytest.raises(ValueError, match="norm_gate_up"):
        norm_gate_up(x, x[0], 1e-6, w[:3])
    with pytest.raises(ValueError, match="norm_qkv_rope"):
        cos = torch.ones(4, 1, 48, dtype=torch.bfloat16, device=DEV)
        norm_qkv_rope(x, x[0], 1e-6, w[:96 * 3 // 2], None, cos, cos, 1, 0)
    with pytest.raises(ValueError, match="divide a head's half"):
        cos = torch.ones(4, 1, 64, dtype=torch.bfloat16, device=DEV)
        w3 = torch.randn(3 * 64, 64, dtype=torch.bfloat16, device=DEV)  # q, k, v heads of 64
        norm_qkv_rope(x, x[0], 1e-6, w3, None, cos, cos, 1, 1, tiles=Tiles(bm=16, bn=64))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("T", [1, 8, 72, 128, 256])
@pytest.mark.parametrize("shape", [(576, 9, 3, 64, 1536), (2048, 32, 32, 64, 8192), (1536, 12, 2, 128, 8960)])
def test_gpu_norm_linears_at_model_shapes(T, shape):
    K, H, KVH, D, inter = shape
    for dtype in (torch.bfloat16, torch.float16):
        case = _qkv_case(T, K, H, KVH, D, dtype, False, dtype == torch.float16, seed=T + K)
        _check(norm_qkv_rope(*case), _qkv_reference(*case), _unfused_qkv(*case), dtype,
               ulps=2 if dtype == torch.float16 else 1)
        case = _gate_up_case(T, K, inter, dtype, seed=T + inter)
        _check(norm_gate_up(*case), _gate_up_reference(*case), _unfused_gate_up(*case), dtype, ulps=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_model_with_fused_norm_linears_matches_unfused(dtype, kv):
    """The model with `fuse_norm_linears` (prefill chunks and decode steps, the keys centered for
    FP8) against the same model unfused, fed the same tokens: every step's logits close, and the
    greedy tokens the same wherever the unfused run's top two are not a tie at the model dtype."""
    model = tiny_model(DEV, attention_bias=True).to(dtype)
    kv = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype] if kv == "auto" else kv
    if centers_keys(kv):
        model.set_key_centers(0.1 * torch.randn(model.config.num_layers, model.config.num_kv_heads,
                                                model.config.head_dim, generator=torch.Generator().manual_seed(3)))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (37,), generator=g).tolist(), torch.randint(0, 256, (9,), generator=g).tolist()]
    want, want_logits = generate(model, TorchBackend(), kv, prompts, 6, DEV, dtype)
    model.fuse_norm_linears()
    try:
        _, got_logits = generate(model, TorchBackend(), kv, prompts, 6, DEV, dtype, forced=want)
    finally:
        model.fuse_norm_linears(False)
    want_logits, got_logits = want_logits.float(), got_logits.float()
    assert not torch.equal(got_logits, want_logits), "the fused kernels did not run"
    err = ((got_logits - want_logits).norm() / want_logits.norm()).item()
    assert err < 4 * ULP[dtype], f"logits relative L2 {err:.2e}"
    top2 = want_logits.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 4 * ULP[dtype] * top2[:, 0].abs().clamp(min=1.0)
    same = got_logits.argmax(-1) == want_logits.argmax(-1)
    assert same[decided].all()
