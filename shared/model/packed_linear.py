"""Linear layers whose weight is pre-packed once for the CPU GEMM library: `PackedLinear` (fp32,
MKL's sgemm) and `PackedBf16Linear` (bf16, oneDNN, AMX where the CPU has it).

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

bf16: `F.linear` hands bf16 to oneDNN, which reorders the weight into its blocked (AMX) layout on
every call; `torch.ops.mkldnn._reorder_linear_weight` does it once and `_linear_pointwise` runs the
GEMM (the ops inductor's CPU freezing uses). Same kernel, bit-identical to `F.linear` at every row
count tried; SmolLM2's decode-shaped GEMMs at one thread about 1.7x faster (M = 32: qkv 0.12 ->
0.07 ms, gate_up 0.40 -> 0.23 ms, output head 9.2 -> 5.7 ms). oneDNN also fuses an elementwise
epilogue into the GEMM, applied to the fp32 accumulator before the one rounding to bf16: `swish`
(silu), `add` and `mul` of another tensor (`silu`, `add_to`, `mul_by`), so the MLP and the residual
adds cost no extra pass over the activations. These round once where the unfused ops round twice:
they differ from them by about one bf16 ulp.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.kernels.cpu_native import NativeKernels


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


    def add_to(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """other + x Wᵀ + b (the residual add; same values as the two ops)."""
        return other + self(x)


@functools.lru_cache(maxsize=1)
def onednn_bf16_packing_works() -> bool:
    """Whether this torch build and CPU run oneDNN's packed bf16 linear, with the same values as
    `F.linear` (a capability probe, run once per process)."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    try:
        if not ops._is_mkldnn_bf16_supported():
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(40, 24, generator=gen).bfloat16()  # [N, K]
        packed = ops._reorder_linear_weight(w, PACK_ROWS)
        for m in (1, 3, 17, 64):
            x = torch.randn(m, 24, generator=gen).bfloat16()
            if not torch.equal(ops._linear_pointwise(x, packed, None, "none", [], ""), F.linear(x, w)):
                return False
    except (RuntimeError, AttributeError):  # ops missing, or the CPU lacks bf16 support
        return False
    return True


PACK_ROWS = 32  # the row count oneDNN picks its weight layout for; serves any row count
AMX_MAX_ROWS = 64  # up to here (decode steps) the AMX kernel, beyond it (prompts) oneDNN


def _amx_tiles(native: NativeKernels | None, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's AMX tiles where the C AMX linear runs here and takes its shape, else None."""
    N, K = weight.shape
    if native is None or N % 32 or K % 32 or not native.amx_ready():
        return None
    return native.amx_pack(weight.detach())


class PackedBf16Linear(nn.Module):
    """y = x Wᵀ + b through oneDNN with a pre-packed bf16 weight; with `native` on an AMX CPU, up
    to AMX_MAX_ROWS rows through the C AMX kernel (`kernels/native_amx.py`: the weight read as one
    stream, 1.4-2x oneDNN's speed at decode row counts; its tiles are a third copy of the weight).
    x: [..., K] bf16 -> [..., N]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, native: NativeKernels | None = None) -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PackedBf16Linear needs a 2-d bfloat16 CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.weight = weight  # [N, K] (the original, for other readers)
        self.bias = bias  # [N] or None
        # a plain attribute, not a buffer: an MKL-DNN tensor must not enter state_dict or .to()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)
        self.native = native
        self.amx = _amx_tiles(native, weight)  # bf16 [N * K] or None (plain attribute, as `packed`)

    def _amx_rows(self, x: torch.Tensor) -> bool:
        return self.amx is not None and x.dim() == 2 and 0 < x.shape[0] <= AMX_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._amx_rows(x):
            return self.native.amx_linear(x, self.amx, self.weight.shape[0], self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x Wᵀ + b), silu in the GEMM's epilogue."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")

    def mul_by(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x Wᵀ + b) * other, other [..., N] of x's dtype."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")

    def add_to(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """other + x Wᵀ + b, other [..., N] of x's dtype (the residual add)."""
        if self._amx_rows(x) and other.dim() == 2 and other.stride(1) == 1 and other.dtype == torch.bfloat16:
            return self.native.amx_linear(x, self.amx, self.weight.shape[0], self.bias, op=1, other=other)
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")


class PackedGateUp(nn.Module):
    """The gated MLP's first half, silu(x Gᵀ) * (x Uᵀ), over a fused bf16 weight [G; U] [2I, K]:
    two packed GEMMs, silu in the first's epilogue, * in the second's (2048 x 576 prompt rows at one
    thread, whole MLP: 29.5 -> 12.6 ms; 32 rows 0.84 -> 0.52 ms). x: [..., K] bf16 -> [..., I]."""

    def __init__(self, weight: torch.Tensor, inter: int, native: NativeKernels | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.shape[0] != 2 * inter:
            raise ValueError(f"PackedGateUp needs a [2 * {inter}, K] weight, got {tuple(weight.shape)}")
        self.weight = weight  # [2I, K] (the original, for other readers; row halves are views of it)
        self.gate = PackedBf16Linear(weight[:inter], None)
        self.up = PackedBf16Linear(weight[inter:], None)
        # decode rows: one AMX pass over [G; U], silu(g) rounded to bf16 times u (oneDNN's numerics)
        self.native = native
        self.amx = _amx_tiles(native, weight)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx is not None and x.dim() == 2 and 0 < x.shape[0] <= AMX_MAX_ROWS:
            return self.native.amx_linear(x, self.amx, self.weight.shape[0], op=2)
        return self.up.mul_by(x, self.gate.silu(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The plain layer's output, [..., 2I] = cat(x Gᵀ, x Uᵀ) (for readers of the unfused form)."""
        return torch.cat([self.gate(x), self.up(x)], dim=-1)


def packed(lin: nn.Linear, native: NativeKernels | None = None) -> nn.Module | None:
    """The packed form of a CPU linear layer (fp32: MKL, bf16: oneDNN, and AMX for decode rows with
    `native`), or None where this torch build or CPU has no packed GEMM for its dtype."""
    w = lin.weight
    if w.device.type != "cpu":
        return None
    if w.dtype == torch.float32 and mkl_packing_works():
        return PackedLinear(w, lin.bias)
    if w.dtype == torch.bfloat16 and onednn_bf16_packing_works():
        return PackedBf16Linear(w, lin.bias, native)
    return None


def pack_linears(module: nn.Module, native: NativeKernels | None = None) -> int:
    """Replaces every CPU `nn.Linear` under `module` that `packed` can pack (fp32, bf16) by its
    packed form over the same parameters; returns how many it replaced."""
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    n = 0
    for parent, name, child in swaps:
        p = packed(child, native)
        if p is not None:
            setattr(parent, name, p)
            n += 1
    return n
