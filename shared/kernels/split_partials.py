"""What the register-direct decode kernels share around their loop: the end of a split program in
Gluon (write this split's normalized partial and its log2-sum-exp, and, with FUSED, let the last
split of each (sequence, KV head) combine them, a self-resetting counter per pair
`splits.COUNTERS`, instead of `reduce_splits_kernel`'s second launch), and the launcher that fills
their common arguments and chooses splits. GPU only."""
from __future__ import annotations

import torch

from kvmesh.kernels.mma_fragments import CHUNK, HAVE_GLUON
from kvmesh.kernels.paged_attention import LOG2E
from kvmesh.kernels.splits import COUNTERS, launch_split, num_sms, num_splits, resident_of, slot_cost

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from kvmesh.kernels.mma_fragments import CHUNK_C
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed after Triton 3.6

    @gluon.jit
    def work_unit(work_ptr, u, num_splits, WORK: gl.constexpr):
        """(sequence, split, that sequence's splits) of a program whose batch axis is `u`: a ragged
        batch's unit u of the work list (WORK, `work_list.py`), else sequence u and grid axis 2."""
        if WORK:
            unit = gl.load(work_ptr + u)
            b, split, n_split = unit >> 16, (unit >> 8) & 255, unit & 255
        else:
            b, split, n_split = u, gl.program_id(2), num_splits
        return b, split, n_split

    @gluon.jit
    def reduce_partials(part_out_ptr, part_lse_ptr, out_ptr, b, kvh, stride_ob, stride_oh, num_splits, u0, n_split,
                        KVH: gl.constexpr, G: gl.constexpr, D: gl.constexpr, RMAX: gl.constexpr, H0: gl.constexpr = 0,
                        WORK: gl.constexpr = False):
        """Combine every split's partial of (b, kvh), weights 2**(lse - max), into out: RMAX >=
        num_splits partials in one unrolled pass, so their loads are all in flight at once (two
        passes of dependent loads, max then sum, cost 0.7-0.9 % at 64 x 4,096, H200). Loads bypass
        L1 (.cg): the partials were written by other SMs. Heads H0 .. H0 + 7 of the group (8 at a time:
        the unrolled pass holds RMAX partials of 8 heads in registers). WORK: the partials are rows
        (u0 + i) H + head of [U, H] (units u0 .. u0 + n_split - 1 are the sequence's splits)."""
        # 8 channels a lane: 16-byte output stores (each store holds its registers until the store unit
        # takes it, and this program's end is the launch's)
        RL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // (D // 8), D // 8],
                                            warps_per_cta=[1, 1], order=[1, 0])
        h = H0 + gl.arange(0, 8, layout=gl.SliceLayout(1, RL))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, RL))
        hm = h < G
        if WORK:
            ph = u0.to(gl.int64) * (KVH * G) + kvh * G + h  # [8] first partial of each head
            step = KVH * G
        else:
            ph = (b.to(gl.int64) * (KVH * G) + kvh * G + h) * num_splits  # [8] first partial of each head
            step = 1
        m = gl.full([8], -1.0e30, gl.float32, layout=gl.SliceLayout(1, RL))
        acc = gl.zeros([8, D], gl.float32, layout=RL)
        wsum = gl.zeros([8], gl.float32, layout=gl.SliceLayout(1, RL))
        for i in gl.static_range(RMAX):  # unrolled, online weights: no load waits for another
            ok = hm & (i < n_split)  # empty splits have lse -inf: weight 0
            lse = gl.load(part_lse_ptr + ph + i * step, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = gl.load(part_out_ptr + ((ph + i * step) * D)[:, None] + d[None, :], mask=ok[:, None], other=0.0,
                        cache_modifier=".cg")
            m_new = gl.maximum(m, lse)
            a = gl.exp2(m - m_new)
            w = gl.exp2(lse - m_new)
            acc = acc * a[:, None] + o * w[:, None]
            wsum = wsum * a + w
            m = m_new
        o = acc / gl.where(wsum > 0.0, wsum, 1.0)[:, None]
        op = out_ptr + b.to(gl.int64) * stride_ob + ((kvh * G + h) * stride_oh)[:, None] + d[None, :]
        gl.store(op, o.to(out_ptr.dtype.element_ty), mask=hm[:, None])

    @gluon.jit
    def _region_lines(off, i, start, N: gl.constexpr, PER_ROW: gl.constexpr, per_row, first: gl.constexpr):
        """Lanes first.. first + (N + 127) // 128 of the line table: the 128-byte lines of N bytes at start."""
        j = i - first
        here = (j >= 0) & (j < (N + 127) // 128 + 1)
        off = gl.where(here, start + gl.minimum(128 * j, N - 1), off)
        return off, gl.where(here, PER_ROW, per_row)

    @gluon.jit
    def chunk_lines(s0, s1, s2, s3, N0: gl.constexpr, N1: gl.constexpr, N2: gl.constexpr, N3: gl.constexpr,
                    R0: gl.constexpr, R1: gl.constexpr, R2: gl.constexpr, R3: gl.constexpr):
        """Byte offsets, inside a page's layer region, of every 128-byte line of four regions a chunk
        reads (region k: Nk bytes from sk, moving Rk bytes a row with the chunk's first row), one a
        lane (32 or 64 lines: the rest repeat the first), and the bytes a row of each."""
        L0: gl.constexpr = (N0 + 127) // 128 + 1
        L1: gl.constexpr = (N1 + 127) // 128 + 1
        L2: gl.constexpr = (N2 + 127) // 128 + 1
        L3: gl.constexpr = (N3 + 127) // 128 + 1
        NL: gl.constexpr = 32 if L0 + L1 + L2 + L3 <= 32 else 64
        i = gl.arange(0, NL, layout=gl.BlockedLayout([NL // 32], [32], [1], [0]))
        off = i * 0 + s0
        per_row = i * 0
        off, per_row = _region_lines(off, i, s0, N0, R0, per_row, 0)
        off, per_row = _region_lines(off, i, s1, N1, R1, per_row, L0)
        off, per_row = _region_lines(off, i, s2, N2, R2, per_row, L0 + L1)
        off, per_row = _region_lines(off, i, s3, N3, R3, per_row, L0 + L1 + L2)
        return off, per_row

    @gluon.jit
    def page_base(pool_ptr, page, page_stride, layer_off):
        """The byte address of a page's layer region (page -1, never read, -> 0): one 64-bit pointer a
        chunk, so each load costs one address at most."""
        return pool_ptr + (gl.maximum(page, 0).to(gl.int64) * page_stride + layer_off)

    @gluon.jit
    def prefetch_l2(pool_ptr, page, chunk, lines, per_row, page_stride, layer_off, BS: gl.constexpr):
        """Asks L2 for every line of a chunk (`chunk_lines`; one prefetch.global.L2 a lane), two chunks
        ahead of its loads, so they find it there."""
        pb = page_base(pool_ptr, page, page_stride, layer_off)
        if BS // CHUNK_C > 1:
            lines = lines + (chunk % (BS // CHUNK_C)) * CHUNK_C * per_row
        gl.inline_asm_elementwise(asm="prefetch.global.L2 [$1]; mov.u32 $0, 0;", constraints="=r,l",
                                  args=[pb + lines], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def store_output(o, l_i, m_i, out_ptr, part_out_ptr, part_lse_ptr, count_ptr, b, kvh, split,
                     stride_ob, stride_oh, num_splits, u, n_split, KVH: gl.constexpr, G: gl.constexpr,
                     D: gl.constexpr, PARTIAL: gl.constexpr, FUSED: gl.constexpr, RMAX: gl.constexpr,
                     WORK: gl.constexpr = False):
        """o: O^T [D, NH] normalized (MMA layout; NH = 8 or 16 head columns), its rows in logical
        channel order (row m holds memory channel (D/8) (m % 8) + m // 8), l_i / m_i [NH] the softmax
        sum and max (base 2) per head: the output, or this split's partial (RMAX: see reduce_partials).
        Stored as [NH heads, D] rows, 16 bytes a lane a store: straight from the MMA layout each lane
        held scattered channels, one 2-byte store apiece, and each store held its register until the
        store unit took it (a third of a short program's time, H200). WORK: unit u of a ragged batch's
        work list, split `split` of the sequence's `n_split` (`work_list.py`); partials [U, H, D]."""
        NH: gl.constexpr = o.shape[1]
        rows = gl.reshape(gl.permute(gl.reshape(o, [D // 8, 8, NH]), [2, 1, 0]), [NH, D])  # [head, channel]
        VEC: gl.constexpr = 4 if PARTIAL else 8  # 16 bytes of fp32 or of 16-bit values
        LANES: gl.constexpr = D // VEC if D // VEC < 32 else 32  # lanes along a row
        SL: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES, LANES], [1, 1], [1, 0])
        rows = gl.convert_layout(rows, SL)
        hr = gl.arange(0, NH, layout=gl.SliceLayout(1, SL))
        cr = gl.arange(0, D, layout=gl.SliceLayout(0, SL))
        if PARTIAL:
            if WORK:
                ph = u.to(gl.int64) * (KVH * G) + kvh * G + hr  # [NH] row of [U, H]
                gl.store(part_out_ptr + (ph * D)[:, None] + cr[None, :], rows, mask=(hr < G)[:, None])
                hh = gl.arange(0, NH, layout=l_i.type.layout)
                lse_rows = u.to(gl.int64) * (KVH * G) + kvh * G + hh
            else:
                ph = b.to(gl.int64) * (KVH * G) + kvh * G + hr  # [NH] row of [B, H]
                gl.store(part_out_ptr + ((ph * num_splits + split) * D)[:, None] + cr[None, :], rows,
                         mask=(hr < G)[:, None])
                hh = gl.arange(0, NH, layout=l_i.type.layout)
                lse_rows = (b.to(gl.int64) * (KVH * G) + kvh * G + hh) * num_splits + split
            lse = gl.where(l_i > 0.0, m_i + gl.log2(gl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
            gl.store(part_lse_ptr + lse_rows, lse, mask=hh < G)
            if FUSED:
                cta_barrier()  # every lane's partial is written before the count says so
                done = gl.atomic_add(count_ptr + b * KVH + kvh, 1, sem="acq_rel", scope="gpu")
                if done == n_split - 1:
                    for h0 in gl.static_range(0, NH, 8):
                        reduce_partials(part_out_ptr, part_lse_ptr, out_ptr, b, kvh, stride_ob, stride_oh,
                                        num_splits, u - split, n_split, KVH, G, D, RMAX, h0, WORK)
                    gl.store(count_ptr + b * KVH + kvh, 0)  # ready for the next launch
        else:
            op = out_ptr + b.to(gl.int64) * stride_ob + ((kvh * G + hr) * stride_oh)[:, None] + cr[None, :]
            gl.store(op, rows.to(out_ptr.dtype.element_ty), mask=(hr < G)[:, None])


FUSED_MAX_SPLITS = 4  # one warp reducing 16 splits' partials cost more than the second launch (H200)


def launch_direct(kernel, tag: str, cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta,
                  scale: float, *, splits: int | None, fused: bool | None, maxnreg,
                  **consts) -> torch.Tensor:
    """out [B, H, D] from a register-direct decode kernel (one warp a program) over the cache's pages:
    its common arguments, `consts` the kernel's own; `splits` None: from shapes and the compiled
    kernel's residency (read once per variant, `tag`); `fused` None: the last split reduces up to
    FUSED_MAX_SPLITS splits; `maxnreg` None: no register cap; a tuple of (cap, relative chunk
    time) options: the one of least `slot_cost` for this launch's shape (from shapes only)."""
    L = cache.layout
    B, H, D = q.shape
    G = H // L.kv_heads
    bt = meta.block_tables
    if bt.shape[1] == 0:  # the kernel reads entry 0 of a row even when a sequence has no pages
        bt = torch.zeros(B, 1, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    res = cache.residual
    counters = COUNTERS.get(q.device, B * L.kv_heads) if fused is not False else None
    args = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, out_ptr=out, count_ptr=counters if counters is not None else bt,
        pool_ptr=cache.pool, res_ptr=res, prefix_lens_ptr=meta.prefix_lens, block_tables_ptr=bt,
        residual_slots_ptr=meta.residual_slots,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_kb=k.stride(0), stride_vb=v.stride(0),
        stride_ob=out.stride(0), stride_oh=out.stride(1), stride_bt=bt.stride(0),
        page_stride=L.block_bytes, layer_off=layer * L.layer_bytes,
        slot_stride=res.stride(0), res_layer_off=layer * res.stride(1), qk_scale=scale * LOG2E, g_rows=G,
        V_OFF=L.v_data_offset, KS_OFF=L.k_scale_offset, VS_OFF=L.v_scale_offset, KVH=L.kv_heads, G=G,
        BS=L.block_size, D=D, FUSED=counters is not None, BF16=q.dtype == torch.bfloat16, num_warps=1,
        **consts)
    ctx, contexts, sms = meta.max_prefix_len + 1, meta.contexts, num_sms(q.device)
    options = maxnreg if isinstance(maxnreg, tuple) else ((maxnreg, 1.0),)
    best = None
    for cap, chunk_time in options:
        option = {**args, **({} if cap is None else {"maxnreg": cap})}
        if splits is not None and len(options) == 1:  # nothing to choose: no residency probe
            best = (0.0, option, splits)
            break
        resident = resident_of(tag, kernel, option, q.device)
        n = splits or num_splits(B, L.kv_heads, ctx, sms, resident, CHUNK, contexts)
        cost = chunk_time * slot_cost(B, L.kv_heads, ctx, sms, resident, n, contexts)
        if best is None or cost < best[0]:
            best = (cost, option, n)
    _, args, splits = best
    if fused is None and args["FUSED"]:
        args["FUSED"] = splits <= FUSED_MAX_SPLITS
    args["RMAX"] = max(FUSED_MAX_SPLITS, 1 << (splits - 1).bit_length())  # a power of two >= splits
    return launch_split(kernel, out, L.kv_heads, splits, args, contexts, meta.work)
