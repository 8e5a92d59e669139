"""The Triton decode kernels' split partials (flash-decoding): which sequence and split a program
serves (a ragged batch's work list, `work_list.py`, or the grid), where its partial goes, and how a
sequence's partials combine, weights 2**(lse - max): by the split that finishes last
(`combine_own_splits`, the plain kernel's FUSED path) or in a second launch. The Gluon direct
kernels' counterparts are in split_partials.py."""
from __future__ import annotations

import triton
import triton.language as tl

from kvmesh.kernels.paged_attention import _cast_out


@triton.jit
def work_unit(work_ptr, u, num_splits, WORK: tl.constexpr):
    """(sequence, split, that sequence's splits) of a decode program whose batch axis is `u`: a
    ragged batch's unit u of the work list (WORK, `work_list.py`), else sequence u and grid axis 2."""
    if WORK:
        unit = tl.load(work_ptr + u)
        b, split, n_split = unit >> 16, (unit >> 8) & 255, unit & 255
    else:
        b, split, n_split = u, tl.program_id(2), num_splits
    return b, split, n_split


@triton.jit
def partial_rows(b, u, head, split, num_splits, H: tl.constexpr, WORK: tl.constexpr):
    """Rows of a decode program's partials: [U, H] per unit (WORK), else [B, H, splits]."""
    if WORK:
        rows = u.to(tl.int64) * H + head
    else:
        rows = (b.to(tl.int64) * H + head) * num_splits + split
    return rows


@triton.jit
def combine_own_splits(part_out_ptr, part_lse_ptr, b, u0, head, row_ok, d, n_split, num_splits,
                       H: tl.constexpr, D: tl.constexpr, WORK: tl.constexpr):
    """The output [M, D] of one (sequence, KV head)'s n_split partials, for the heads `head` [M]:
    combined by the split that finished last (a decode kernel's FUSED path), weights 2**(lse - max)
    online. Loads bypass L1 (.cg): other SMs wrote the partials. WORK: units u0 .. u0 + n_split - 1."""
    m = head.to(tl.float32) * 0.0 - 1.0e30  # [M]
    wsum = m * 0.0
    acc = tl.zeros((head.shape[0], D), tl.float32)
    for i in range(0, n_split):
        pr = partial_rows(b, u0 + i, head, i, num_splits, H, WORK)  # [M]
        lse = tl.load(part_lse_ptr + pr, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_out_ptr + (pr * D)[:, None] + d[None, :], mask=row_ok[:, None], other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        a = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new)
        acc = acc * a[:, None] + o * w[:, None]
        wsum = wsum * a + w
        m = m_new
    return acc / tl.where(wsum > 0.0, wsum, 1.0)[:, None]


@triton.jit
def reduce_splits_kernel(
    part_out_ptr,  # fp32 [T, H, SPLITS, D], or [U, H, D] (WORK)
    part_lse_ptr,  # fp32 [T, H, SPLITS], or [U, H] (WORK)
    out_ptr,  # [T, H, D]
    stride_ot, stride_oh,
    seq_units_ptr,  # int32 [T]: first unit << 8 | splits of each sequence (WORK; work_list.py)
    H: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr,
    HB: tl.constexpr,  # heads a program
    SB: tl.constexpr,  # splits a step (a power of two)
    WORK: tl.constexpr = False,
):
    """Combines the splits of HB heads of one token, weights 2**(lse - max), SB splits a step with
    the running max rescaled between steps: a sequence's loads cover its own splits only (a ragged
    batch's short sequences have a few where the longest has up to 128), all SB in flight at once."""
    t = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)  # [HB]
    hm = h < H
    sp = tl.arange(0, SB)
    d = tl.arange(0, D)
    if WORK:  # this sequence's splits are units first .. first + n - 1 of the work list
        e = tl.load(seq_units_ptr + t)
        first, n = e >> 8, e & 255
    else:
        first, n = 0, SPLITS
    m = tl.full((HB,), -1.0e30, tl.float32)
    acc = tl.zeros((HB, D), tl.float32)
    wsum = tl.zeros((HB,), tl.float32)
    for s0 in range(0, n, SB):
        s = s0 + sp  # [SB]
        ok = hm[:, None] & (s < n)[None, :]  # [HB, SB]
        if WORK:
            rows = (first + s).to(tl.int64)[None, :] * H + h[:, None]
        else:
            rows = (t.to(tl.int64) * H + h)[:, None] * SPLITS + s[None, :]
        lse = tl.load(part_lse_ptr + rows, mask=ok, other=float("-inf"))  # [HB, SB]; empty splits -inf
        o = tl.load(part_out_ptr + (rows * D)[:, :, None] + d[None, None, :], mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        a = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new[:, None])  # [HB, SB]
        acc = acc * a[:, None] + tl.sum(o * w[:, :, None], axis=1)
        wsum = wsum * a + tl.sum(w, axis=1)
        m = m_new
    o = acc / tl.where(wsum > 0.0, wsum, 1.0)[:, None]
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + (h * stride_oh)[:, None] + d[None, :],
             _cast_out(o, out_ptr.dtype.element_ty), mask=hm[:, None])
