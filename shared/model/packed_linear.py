"""`PackedLinear`: an fp32 linear layer whose weight is pre-packed for MKL's sgemm (CPU only).

MKL's sgemm copies the weight matrix into its own panel layout on every call. With the few rows of
a decode step that copy is a large part of the work (measured, SmolLM2's 30 layers + output head at
one thread: 32 rows 125 -> 100 ms, 8 rows 98 -> 61 ms, 2048 rows 3 % less). `cblas_sgemm_pack`
does it once at load time; torch exposes it as `torch.ops.mkl._mkl_reorder_linear_weight` and
`torch.ops.mkl._mkl_linear`. The op takes the packed path only when its `batch_size` argument equals
the row count, so we pass the row count on every call: the packed weight depends on N and K only
(its size does not change with the batch size it was packed for), which `mkl_packing_works` checks
at several row counts before anything is packed.

Results: bit-identical to `F.linear` from 16 or 32 rows on (same kernel); with fewer rows MKL's plain
path uses a different small-matrix kernel, so the two differ by fp32 rounding (~1e-6 relative).
Memory: the packed copy sits beside the original weight, which stays for any other reader.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.lru_cache(maxsize=1)
def mkl_packing_works() -> bool:
    """Whether this torch build has the MKL packed-GEMM ops and they agree with `F.linear` at
    row counts other than the one packed for (a capability probe, run once per process)."""
    ops = getattr(torch.ops, "mkl", None)
    if not torch.backends.mkl.is_available() or ops is None:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(40, 24, generator=gen)  # [N, K]
        b = torch.randn(40, generator=gen)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
        for m in (1, 3, 17, 64):
            x = torch.randn(m, 24, generator=gen)
            got = torch.ops.mkl._mkl_linear(x, packed, w, b, m)
            if not torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5):
                return False
    except (RuntimeError, AttributeError):  # ops missing or not built with MKL/oneDNN
        return False
    return True


class PackedLinear(nn.Module):
    """y = x Wᵀ + b through MKL's packed sgemm. x: [..., K] float32 -> [..., N]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PackedLinear needs a 2-d float32 CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.weight = weight  # [N, K] (the original: shape source for the op, and for other readers)
        self.bias = bias  # [N] or None
        # a plain attribute, not a buffer: an MKL-DNN tensor must not enter state_dict or .to()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)


def pack_linears(module: nn.Module) -> int:
    """Replaces every float32 CPU `nn.Linear` under `module` by a `PackedLinear` over the same
    parameters; returns how many it replaced (0 when MKL packing is unavailable)."""
    if not mkl_packing_works():
        return 0
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.float32
             and child.weight.device.type == "cpu"]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    return len(swaps)
