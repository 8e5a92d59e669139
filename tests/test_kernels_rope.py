"""The one-launch RoPE (`kernels/rope.py`) against the torch rotate-half (`RotaryEmbedding.rotate`) on
fresh random data: q and k heads as the model passes them (a view into its qkv rows), head_dim 64
and 128, fp32 exactly as torch computes in fp32, fp16 / bf16 within one rounding of the fp32 result.
CPU: Triton's interpreter; GPU (marked): the compiled kernel, and the model's `apply` takes it."""
from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.rope import apply_rope
from kvmesh.model.rope import RotaryEmbedding

ON_GPU = torch.cuda.is_available()


def _case(T: int, heads: int, kvh: int, D: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, heads + 2 * kvh, D, generator=g).to(dtype).to(device)
    rope = RotaryEmbedding(D, 10000.0, None)
    positions = torch.randint(0, 4096, (T,), generator=g).to(device)
    cos, sin = rope.cos_sin(positions, dtype)
    return qkv[:, :heads + kvh], cos, sin  # x: [T, H + KVH, D], rows at qkv's stride


@pytest.mark.parametrize("T, heads, kvh, D", [(5, 9, 3, 64), (3, 32, 8, 128), (1, 4, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_kernel_matches_torch(T, heads, kvh, D, dtype):
    dev = "cuda" if ON_GPU else "cpu"
    x, cos, sin = _case(T, heads, kvh, D, dtype, dev, seed=T * D)
    got = apply_rope(x, cos, sin)
    exact = RotaryEmbedding.rotate(x.float(), cos.float(), sin.float())  # fp32: one rounding to dtype
    assert got.shape == x.shape and got.is_contiguous() and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
    else:
        ulp = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
        assert ((got.float() - exact).abs() <= ulp * exact.abs().clamp(min=1e-3)).all()
        want = RotaryEmbedding.rotate(x, cos, sin)  # torch in dtype: three roundings
        assert (got.float() - want.float()).norm() <= 4 * ulp * want.float().norm()


def test_rope_kernel_refuses_what_it_cannot_read():
    x = torch.randn(2, 4, 48)
    cos = sin = torch.ones(2, 1, 48)
    with pytest.raises(ValueError, match="power-of-two"):
        apply_rope(x, cos, sin)


@pytest.mark.gpu
def test_gpu_model_rope_takes_the_kernel():
    x, cos, sin = _case(4, 9, 3, 64, torch.bfloat16, "cuda", seed=1)
    torch.testing.assert_close(RotaryEmbedding.apply(x, cos, sin), apply_rope(x, cos, sin), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_kernel_centers_the_keys(dtype):
    """With key centers (FP8 KV) the keys lose theirs in the same launch, bit for bit what the rotation
    followed by torch's subtraction gives; the query heads are untouched. (The interpreter narrows
    fp32 to bf16 by truncation, environment.md: there bf16 keys agree within one bf16 ulp.)"""
    dev = "cuda" if ON_GPU else "cpu"
    x, cos, sin = _case(3, 9, 3, 64, dtype, dev, seed=7)
    center = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(dtype).to(dev)
    got = apply_rope(x, cos, sin, center)
    plain = apply_rope(x, cos, sin)
    assert torch.equal(got[:, :9], plain[:, :9])
    if ON_GPU or dtype != torch.bfloat16:
        assert torch.equal(got[:, 9:], plain[:, 9:] - center)
    else:
        want = (plain[:, 9:] - center).float()
        assert ((got[:, 9:].float() - want).abs() <= 2 ** -7 * want.abs().clamp(min=2 ** -7)).all()
    assert not torch.equal(got[:, 9:], plain[:, 9:])
    with pytest.raises(ValueError, match="key_center"):
        apply_rope(x, cos, sin, center.float() if dtype != torch.float32 else center.half())
    # the model's form: the kernel on a GPU, the torch rotation and an in-place subtraction elsewhere
    want = RotaryEmbedding.rotate(x, cos, sin)
    want[:, 9:] -= center
    model = RotaryEmbedding.apply(x, cos, sin, center)
    if ON_GPU:
        assert torch.equal(model, got)
    else:  # the torch form: bit for bit the rotation, then the subtraction
        assert torch.equal(model, want)
