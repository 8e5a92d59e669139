"""`TorchBackend`: the pure-torch attention backend (the CPU serving path and the kernels' reference).

attend: for each sequence, its context = dequantized full pages ++ residual tail ++ its new K/V;
causal attention with GQA, softmax and accumulation in float32. The step's index math (which rows
decode, which pages to read, the key masks) is done once per step in a `_StepPlan` and reused by
every layer. Three paths:
  - decode (one new token): all such sequences at once; pages are gathered heads first
    ([KVH, G, pages * bs, D], one row copy per page and head), scored with one batched matmul per
    part (pages, residual tail, own token) and softmaxed together under an additive key mask;
  - a fresh prompt run (no cached prefix): one `scaled_dot_product_attention(is_causal=True)` per
    group of equal-length runs;
  - a run after a cached prefix: one SDPA per query chunk over the assembled context with an
    explicit causal mask (the chunk bounds the mask, and the score matrix if SDPA falls back).
write: follows the `WritePlan` (gather rows of cat(residual, new), quantize completed blocks into
their pages, copy leftovers into the residual slots). All gathers happen before any write, since a
leftover may land on a residual row that a completed block just consumed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kv.pool import KVCache
from kvmesh.kv.quant import dequantize, quantize_blocks, store_blocks

QUERY_CHUNK = 512  # query rows per SDPA call after a cached prefix: bounds the [chunk, ctx] mask


@dataclass(frozen=True)
class _DecodePlan:
    """The sequences with exactly one new token, as one batch of G."""

    rows: torch.Tensor | None
    """int64 [G]: their query rows; None when they are all T rows, in order."""
    slots: torch.Tensor
    """int64 [G]: residual slots."""
    page_ids: torch.Tensor
    """int64 [G * nfull]: full pages, sequence-major; short tables padded with page 0 (masked)."""
    nfull: int
    """Most full pages of any of them."""
    bias: torch.Tensor
    """float32 [G, nfull * bs + bs + 1]: 0 where a key may be attended, -inf elsewhere
    (keys: pages, residual tail, own token)."""


@dataclass(frozen=True)
class _Run:
    """A run of new tokens (more than one) of one sequence."""

    seq: int
    start: int
    n: int
    prefix: int


@dataclass(frozen=True)
class _StepPlan:
    key: tuple
    decode: _DecodePlan | None
    fresh: dict[int, list[_Run]]
    """Runs with no cached prefix, by length (one SDPA call per length)."""
    extend: list[_Run]
    """Runs after a cached prefix."""


def _plan_key(meta: AttentionMetadata) -> tuple:
    return (id(meta), id(meta.query_start_loc), id(meta.prefix_lens), id(meta.block_tables),
            id(meta.residual_slots))


def build_step_plan(meta: AttentionMetadata, block_size: int) -> _StepPlan:
    qsl = meta.query_start_loc.tolist()
    prefix = meta.prefix_lens.tolist()
    dev = meta.query_start_loc.device
    dec: list[int] = []
    fresh: dict[int, list[_Run]] = {}
    extend: list[_Run] = []
    for i, p in enumerate(prefix):
        n = qsl[i + 1] - qsl[i]
        if n == 1:
            dec.append(i)
        elif p == 0:
            fresh.setdefault(n, []).append(_Run(i, qsl[i], n, 0))
        else:
            extend.append(_Run(i, qsl[i], n, p))
    decode = None
    if dec:
        bs = block_size
        idx = torch.tensor(dec, dtype=torch.int64, device=dev)
        rows = None if len(dec) == qsl[-1] else meta.query_start_loc.long()[idx]
        p = meta.prefix_lens.long()[idx]  # [G]
        full = p // bs
        nfull = int(full.max())
        table = meta.block_tables[idx, :nfull].long().clamp(min=0)  # [G, nfull]
        pos = torch.arange(nfull * bs + bs + 1, device=dev)[None, :]  # [1, Ltot] key positions
        allowed = torch.where(pos < nfull * bs, pos < (full * bs)[:, None],  # pages
                              pos - nfull * bs < (p % bs)[:, None])  # residual tail (+ own token)
        allowed[:, -1] = True
        bias = torch.zeros(allowed.shape, device=dev).masked_fill_(~allowed, float("-inf"))
        decode = _DecodePlan(rows, meta.residual_slots.long()[idx], table.flatten(), nfull, bias)
    return _StepPlan(_plan_key(meta), decode, fresh, extend)


def _heads_first(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a page view t [N, KVH, ...] -> [KVH, n, ...]: one row gather per head, into
    the heads-first buffer (no second copy to transpose)."""
    out = torch.empty((t.shape[1], ids.numel()) + tuple(t.shape[2:]), dtype=t.dtype, device=t.device)
    for h in range(t.shape[1]):
        torch.index_select(t[:, h], 0, ids, out=out[h])
    return out


def gather_pages(cache: KVCache, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages `ids` (int64 [n]) of one layer, dequantized: k, v float32 [KVH, n, bs, D].
    `dequantize` takes [n, H, ...] parts; here its n is KVH and its H is our n (same broadcasts)."""
    view = cache.layer_view(layer)
    ks = vs = None
    if view.k_scale is not None:
        ks, vs = _heads_first(view.k_scale, ids), _heads_first(view.v_scale, ids)
    return dequantize(_heads_first(view.k, ids), _heads_first(view.v, ids), ks, vs, cache.layout.kv_dtype)


def _gather_rows(cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor,
                 rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of S = cat(residual rows, new rows) -> k, v [m, KVH, D] in the residual dtype."""
    bs = cache.layout.block_size
    base = cache.num_residual_slots * bs
    is_new = rows >= base
    r = rows.clamp(max=base - 1)
    res = cache.residual[:, layer]  # [S, 2, KVH, bs, D]
    rk = res[:, 0][r // bs, :, r % bs]  # [m, KVH, D]
    rv = res[:, 1][r // bs, :, r % bs]
    n = (rows - base).clamp(min=0)
    nk, nv = k[n].to(rk.dtype), v[n].to(rv.dtype)  # [m, KVH, D]
    sel = is_new[:, None, None]
    return torch.where(sel, nk, rk), torch.where(sel, nv, rv)


class TorchBackend:
    """Implements `kvmesh.kernels.backend.AttentionBackend` with plain torch ops on any device."""

    name = "torch"

    def __init__(self) -> None:
        self._plan: _StepPlan | None = None  # the current step's, reused by every layer
        self._plan_meta: AttentionMetadata | None = None  # held so its id is not reused

    def _step_plan(self, meta: AttentionMetadata, block_size: int) -> _StepPlan:
        if self._plan is None or self._plan.key != _plan_key(meta) or self._plan_meta is not meta:
            self._plan = build_step_plan(meta, block_size)
            self._plan_meta = meta
        return self._plan

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self._step_plan(meta, cache.layout.block_size)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
        if plan.decode is not None:
            self._attend_decode(cache, layer, q, k, v, plan.decode, scale, out)
        for n, runs in plan.fresh.items():
            self._attend_fresh(q, k, v, runs, n, scale, out)
        for run in plan.extend:
            self._attend_extend(cache, layer, q, k, v, meta, run, scale, out)
        return out

    def _attend_decode(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, d: _DecodePlan, scale: float, out: torch.Tensor) -> None:
        L = cache.layout
        bs, KVH, D = L.block_size, L.kv_heads, L.head_dim
        H = q.shape[1]
        G = d.slots.numel()
        if d.rows is not None:
            q, k, v = q.index_select(0, d.rows), k.index_select(0, d.rows), v.index_select(0, d.rows)
        Q = (q.float().reshape(G, KVH, H // KVH, D) * scale).transpose(0, 1)  # [KVH, G, R, D]
        res = cache.residual[:, layer].index_select(0, d.slots).float()  # [G, 2, KVH, bs, D]
        kr, vr = res[:, 0].transpose(0, 1), res[:, 1].transpose(0, 1)  # [KVH, G, bs, D]
        kn, vn = k.float().transpose(0, 1)[:, :, None], v.float().transpose(0, 1)[:, :, None]  # [KVH, G, 1, D]
        parts = [torch.matmul(Q, kr.transpose(-1, -2)), torch.matmul(Q, kn.transpose(-1, -2))]
        if d.nfull:
            kp, vp = gather_pages(cache, layer, d.page_ids)  # [KVH, G * nfull, bs, D]
            kp = kp.view(KVH, G, d.nfull * bs, D)
            vp = vp.view(KVH, G, d.nfull * bs, D)
            parts.insert(0, torch.matmul(Q, kp.transpose(-1, -2)))
        scores = torch.cat(parts, dim=-1)  # [KVH, G, R, Ltot]
        probs = torch.softmax(scores.add_(d.bias[None, :, None, :]), dim=-1)
        o = torch.matmul(probs[..., -bs - 1:-1], vr).add_(probs[..., -1:] * vn)  # [KVH, G, R, D]
        if d.nfull:
            o.add_(torch.matmul(probs[..., :d.nfull * bs], vp))
        o = o.transpose(0, 1).reshape(G, H, D)
        if d.rows is None:
            out.copy_(o)
        else:
            out[d.rows] = o.to(out.dtype)

    @staticmethod
    def _attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[_Run], n: int,
                      scale: float, out: torch.Tensor) -> None:
        """Runs of n new tokens with nothing cached before them: plain causal attention."""
        G, H, D = len(runs), q.shape[1], q.shape[2]
        first = runs[0].start
        if all(r.start == first + i * n for i, r in enumerate(runs)):  # adjacent: slices, no gather
            rows = slice(first, first + G * n)
        else:
            rows = torch.cat([torch.arange(r.start, r.start + n, device=q.device) for r in runs])
        Q = q[rows].float().reshape(G, n, H, D).transpose(1, 2)  # [G, H, n, D]
        K = k[rows].float().reshape(G, n, -1, D).transpose(1, 2)  # [G, KVH, n, D]
        V = v[rows].float().reshape(G, n, -1, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(Q, K, V, is_causal=True, scale=scale, enable_gqa=True)
        out[rows] = o.transpose(1, 2).reshape(G * n, H, D).to(out.dtype)

    @staticmethod
    def _attend_extend(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       meta: AttentionMetadata, r: _Run, scale: float, out: torch.Tensor) -> None:
        """A run of new tokens after a cached prefix: context = pages ++ residual tail ++ new rows."""
        bs = cache.layout.block_size
        nfull, tail = divmod(r.prefix, bs)
        slot = int(meta.residual_slots[r.seq])
        res = cache.residual[slot, layer, :, :, :tail].float()  # [2, KVH, tail, D]
        ks, vs = [res[0]], [res[1]]
        if nfull:
            kp, vp = gather_pages(cache, layer, meta.block_tables[r.seq, :nfull].long())  # [KVH, nfull, bs, D]
            ks.insert(0, kp.flatten(1, 2))
            vs.insert(0, vp.flatten(1, 2))
        new = slice(r.start, r.start + r.n)
        ks.append(k[new].float().transpose(0, 1))  # [KVH, n, D]
        vs.append(v[new].float().transpose(0, 1))
        K, V = torch.cat(ks, dim=1)[None], torch.cat(vs, dim=1)[None]  # [1, KVH, prefix + n, D]
        Q = q[new].float().transpose(0, 1)[None]  # [1, H, n, D]
        for j0 in range(0, r.n, QUERY_CHUNK):
            j1 = min(r.n, j0 + QUERY_CHUNK)
            ctx = r.prefix + j1  # keys the last query of this chunk can see
            qpos = r.prefix + torch.arange(j0, j1, device=q.device)  # [Qn]
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [Qn, ctx]
            o = F.scaled_dot_product_attention(Q[:, :, j0:j1], K[:, :, :ctx], V[:, :, :ctx],
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[r.start + j0:r.start + j1] = o[0].transpose(0, 1).to(out.dtype)

    def write(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor,
              meta: AttentionMetadata) -> None:
        plan = meta.write
        bs = cache.layout.block_size
        keep = plan.block_ids >= 0
        ids = plan.block_ids[keep]
        rows = plan.block_rows[keep]  # [nb, bs]
        blocks = None
        if ids.numel():
            bk, bv = _gather_rows(cache, layer, k, v, rows.flatten())
            shape = (ids.numel(), bs) + tuple(bk.shape[1:])
            blocks = quantize_blocks(bk.view(shape), bv.view(shape), cache.layout.kv_dtype)
        tail = None
        if plan.residual_src.numel():
            tail = _gather_rows(cache, layer, k, v, plan.residual_src)
        if blocks is not None:
            store_blocks(cache.layer_view(layer), ids, blocks)
        if tail is not None:
            dst = plan.residual_dst
            res = cache.residual[:, layer]  # [S, 2, KVH, bs, D] (a view: writes land in the cache)
            res[:, 0][dst // bs, :, dst % bs] = tail[0]
            res[:, 1][dst // bs, :, dst % bs] = tail[1]
