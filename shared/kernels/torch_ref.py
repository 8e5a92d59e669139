"""`TorchBackend`: the pure-torch attention backend (the CPU serving path and the kernels' reference).

attend: for each sequence, its context = dequantized full pages ++ residual tail ++ its new K/V;
causal attention with GQA, softmax and accumulation in float32. The step's index math (which rows
decode, which pages to read, the key masks) is done once per step in a `_StepPlan` and reused by
every layer; so are the write plan and the layer's page views. Three paths:
  - decode (one new token): all such sequences at once; pages are gathered heads first
    ([KVH, G, pages * bs, D], one row copy per page and head, no transposing copy), the residual
    block likewise with the own token put at its offset (a private copy); one batched matmul per
    part (pages, residual block), softmaxed together under an additive key mask; with `native`
    set (the CPU serving path: `cpu_native.py`) and unquantized pages, a C kernel reads the rows
    where they lie instead (no gathers, no float32 copies);
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

from kvmesh.kernels.backend import AttentionMetadata, WritePlan
from kvmesh.kernels.cpu_native import NativeKernels
from kvmesh.kv.pool import KVCache, LayerView
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
    seq: torch.Tensor
    """int64 [G]: 0..G-1..."""
    off: torch.Tensor
    """int64 [G]: ...and where each one's own token sits in its residual block (prefix % bs)."""
    full: torch.Tensor
    """int64 [G]: full pages of each (prefix // bs)."""
    bias: torch.Tensor
    """float32 [G, nfull * bs + bs]: 0 where a key may be attended, -inf elsewhere
    (keys: pages, then the residual block up to and including the own token)."""


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
        if n == 0:  # a fixed batch's padding row (`engine/chunk_batch.py`)
            continue
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
        off = p % bs
        pos = torch.arange(nfull * bs + bs, device=dev)[None, :]  # [1, Ltot] key positions
        allowed = torch.where(pos < nfull * bs, pos < (full * bs)[:, None],  # pages
                              pos - nfull * bs <= off[:, None])  # residual tail and own token
        bias = torch.zeros(allowed.shape, device=dev).masked_fill_(~allowed, float("-inf"))
        decode = _DecodePlan(rows, meta.residual_slots.long()[idx], table.flatten(), nfull,
                             torch.arange(len(dec), device=dev), off, full.contiguous(), bias)
    return _StepPlan(_plan_key(meta), decode, fresh, extend)


def _heads_first(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a page view t [N, KVH, ...] -> [KVH, n, ...]: one row gather per head, into
    the heads-first buffer (no second copy to transpose)."""
    out = torch.empty((t.shape[1], ids.numel()) + tuple(t.shape[2:]), dtype=t.dtype, device=t.device)
    for h in range(t.shape[1]):
        torch.index_select(t[:, h], 0, ids, out=out[h])
    return out


def gather_pages(view: LayerView, kv_dtype: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages `ids` (int64 [n]) of one layer's view, dequantized: k, v float32 [KVH, n, bs, D].
    `dequantize` takes [n, H, ...] parts; here its n is KVH and its H is our n (same broadcasts)."""
    ks = vs = None
    if view.k_scale is not None:
        ks, vs = _heads_first(view.k_scale, ids), _heads_first(view.v_scale, ids)
    return dequantize(_heads_first(view.k, ids), _heads_first(view.v, ids), ks, vs, kv_dtype)


@dataclass(frozen=True)
class _RowSource:
    """Rows of S = cat(residual rows [slots * bs], new rows [T]), resolved once per step."""

    new: torch.Tensor
    """int64 [m]: the new row of each row (0 where it is a residual row)."""
    is_new: torch.Tensor | None
    """bool [m, 1, 1]; None when every row is a new row."""
    slot: torch.Tensor
    """int64 [m]: residual slot of each row (0 where it is a new row)..."""
    off: torch.Tensor
    """int64 [m]: ...and the offset inside it."""
    identity: bool
    """The rows are new rows 0..m-1 in order: no gather at all."""

    @staticmethod
    def of(rows: torch.Tensor, num_slots: int, bs: int) -> "_RowSource":
        base = num_slots * bs
        is_new = rows >= base
        r = rows.clamp(max=base - 1)
        n = (rows - base).clamp(min=0)
        all_new = bool(is_new.all())
        identity = all_new and torch.equal(n, torch.arange(n.numel(), device=n.device))
        return _RowSource(n, None if all_new else is_new[:, None, None], r // bs, r % bs, identity)

    def gather(self, cache: KVCache, layer: int, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v [m, KVH, D] in the residual dtype."""
        dt = cache.residual.dtype
        if self.identity and k.shape[0] == self.new.numel():
            return k.to(dt), v.to(dt)
        nk, nv = k.index_select(0, self.new).to(dt), v.index_select(0, self.new).to(dt)  # [m, KVH, D]
        if self.is_new is None:
            return nk, nv
        res = cache.residual[:, layer]  # [S, 2, KVH, bs, D]
        rk = res[:, 0][self.slot, :, self.off]  # [m, KVH, D]
        rv = res[:, 1][self.slot, :, self.off]
        return torch.where(self.is_new, nk, rk), torch.where(self.is_new, nv, rv)


@dataclass(frozen=True)
class _WriteSteps:
    """A `WritePlan` resolved once per step."""

    block_ids: torch.Tensor
    """int64 [nb]: pages of the blocks completed this step (padding dropped)."""
    blocks: _RowSource | None
    """Their rows, nb * bs of them, block after block."""
    tail: _RowSource | None
    """Rows that stay in full precision..."""
    tail_slot: torch.Tensor
    """int64 [m]: ...their residual slots and offsets."""
    tail_off: torch.Tensor

    @staticmethod
    def of(plan: WritePlan, num_slots: int, bs: int) -> "_WriteSteps":
        keep = plan.block_ids >= 0
        ids = plan.block_ids[keep]
        blocks = _RowSource.of(plan.block_rows[keep].flatten(), num_slots, bs) if ids.numel() else None
        keep = plan.residual_dst >= 0  # a fixed plan's spare entries are -1
        src, dst = plan.residual_src[keep], plan.residual_dst[keep]
        tail = _RowSource.of(src, num_slots, bs) if src.numel() else None
        return _WriteSteps(ids, blocks, tail, dst // bs, dst % bs)


class TorchBackend:
    """Implements `kvmesh.kernels.backend.AttentionBackend` with plain torch ops on any device."""

    name = "torch"

    def __init__(self, native: NativeKernels | None = None) -> None:
        # the C decode kernel (`cpu_native.py`), where the serving path enables it; None: pure torch
        self.native = native
        # per-step index math, reused by every layer of the step; the inputs are held so that
        # identity comparisons stay valid (an id is never reused while its object lives)
        self._plan: _StepPlan | None = None
        self._plan_meta: AttentionMetadata | None = None
        self._write: tuple[WritePlan, KVCache, _WriteSteps] | None = None
        self._views: tuple[KVCache, torch.Tensor, dict[int, LayerView]] | None = None

    def _step_plan(self, meta: AttentionMetadata, block_size: int) -> _StepPlan:
        if self._plan is None or self._plan.key != _plan_key(meta) or self._plan_meta is not meta:
            self._plan = build_step_plan(meta, block_size)
            self._plan_meta = meta
        return self._plan

    def _write_steps(self, plan: WritePlan, cache: KVCache) -> _WriteSteps:
        if self._write is None or self._write[0] is not plan or self._write[1] is not cache:
            self._write = (plan, cache, _WriteSteps.of(plan, cache.num_residual_slots, cache.layout.block_size))
        return self._write[2]

    def _layer_view(self, cache: KVCache, layer: int) -> LayerView:
        """Typed page views of one layer, built once per cache (they are views: no copies)."""
        if self._views is None or self._views[0] is not cache or self._views[1] is not cache.pool:
            self._views = (cache, cache.pool, {})
        views = self._views[2]
        if layer not in views:
            views[layer] = cache.layer_view(layer)
        return views[layer]

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self._step_plan(meta, cache.layout.block_size)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
        if plan.decode is not None:
            self._attend_decode(cache, layer, q, k, v, plan.decode, scale, out)
        # the serving path runs bf16 prompts through SDPA in bf16 (its CPU kernel keeps scores and
        # sums in float32 and rounds the probabilities to bf16 for p·v, as transformers in bf16 does;
        # 32 x 64 tokens: 4.3 ms + float32 copies -> 2.1 ms a layer); the reference: float32
        model_dtype = self.native is not None and q.dtype == torch.bfloat16 and q.device.type == "cpu"
        for n, runs in plan.fresh.items():
            self._attend_fresh(q, k, v, runs, n, scale, out, model_dtype)
        for run in plan.extend:
            view = self._layer_view(cache, layer)
            self._attend_extend(cache, view, layer, q, k, v, meta, run, scale, out)
        return out

    def _attend_decode(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, d: _DecodePlan, scale: float, out: torch.Tensor) -> None:
        """Keys: full pages, then the residual block with the own token put at its offset (in a
        private copy of the residual rows; the cache changes only in `write`)."""
        L = cache.layout
        bs, KVH, D = L.block_size, L.kv_heads, L.head_dim
        H = q.shape[1]
        G = d.slots.numel()
        if d.rows is not None:
            q, k, v = q.index_select(0, d.rows), k.index_select(0, d.rows), v.index_select(0, d.rows)
        view = self._layer_view(cache, layer)
        if (self.native is not None and q.device.type == "cpu" and view.k_scale is None
                and self.native.supports(q.dtype, view.k.dtype) and cache.residual.dtype == q.dtype):
            res = cache.residual[:, layer]  # [S, 2, KVH, bs, D]
            o = self.native.attend(q, k, v, view.k, view.v, d.page_ids.view(G, d.nfull), d.full, res[:, 0],
                                   res[:, 1], d.slots, d.off, scale,
                                   out=out if d.rows is None else None)  # [G, H, D], straight from the pool
            if d.rows is not None:
                out[d.rows] = o
            return
        Q = (q.float().reshape(G, KVH, H // KVH, D) * scale).transpose(0, 1)  # [KVH, G, R, D]
        res = cache.residual[:, layer].flatten(1, 2)  # [S, 2 * KVH, bs, D]
        res = _heads_first(res, d.slots).float()  # [2 * KVH, G, bs, D], a copy
        kr, vr = res[:KVH], res[KVH:]  # [KVH, G, bs, D]
        kr[:, d.seq, d.off] = k.float().transpose(0, 1)  # own token: [KVH, G, D]
        vr[:, d.seq, d.off] = v.float().transpose(0, 1)
        scores = torch.matmul(Q, kr.transpose(-1, -2))  # [KVH, G, R, bs]
        if d.nfull:
            kp, vp = gather_pages(view, L.kv_dtype, d.page_ids)  # [KVH, G*nfull, bs, D]
            kp = kp.view(KVH, G, d.nfull * bs, D)
            vp = vp.view(KVH, G, d.nfull * bs, D)
            scores = torch.cat([torch.matmul(Q, kp.transpose(-1, -2)), scores], dim=-1)  # [KVH, G, R, Ltot]
        probs = torch.softmax(scores.add_(d.bias[None, :, None, :]), dim=-1)
        o = torch.matmul(probs[..., -bs:], vr)  # [KVH, G, R, D]
        if d.nfull:
            o.add_(torch.matmul(probs[..., :-bs], vp))
        o = o.transpose(0, 1).reshape(G, H, D)
        if d.rows is None:
            out.copy_(o)
        else:
            out[d.rows] = o.to(out.dtype)

    @staticmethod
    def _attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[_Run], n: int,
                      scale: float, out: torch.Tensor, model_dtype: bool = False) -> None:
        """Runs of n new tokens with nothing cached before them: plain causal attention."""
        G, H, D = len(runs), q.shape[1], q.shape[2]
        first = runs[0].start
        if all(r.start == first + i * n for i, r in enumerate(runs)):  # adjacent: slices, no gather
            rows = slice(first, first + G * n)
        else:
            rows = torch.cat([torch.arange(r.start, r.start + n, device=q.device) for r in runs])
        dt = q.dtype if model_dtype else torch.float32
        Q = q[rows].to(dt).reshape(G, n, H, D).transpose(1, 2)  # [G, H, n, D]
        K = k[rows].to(dt).reshape(G, n, -1, D).transpose(1, 2)  # [G, KVH, n, D]
        V = v[rows].to(dt).reshape(G, n, -1, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(Q, K, V, is_causal=True, scale=scale, enable_gqa=True)
        out[rows] = o.transpose(1, 2).reshape(G * n, H, D).to(out.dtype)

    @staticmethod
    def _attend_extend(cache: KVCache, view: LayerView, layer: int, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, meta: AttentionMetadata, r: _Run, scale: float, out: torch.Tensor) -> None:
        """A run of new tokens after a cached prefix: context = pages ++ residual tail ++ new rows."""
        bs = cache.layout.block_size
        nfull, tail = divmod(r.prefix, bs)
        slot = int(meta.residual_slots[r.seq])
        res = cache.residual[slot, layer, :, :, :tail].float()  # [2, KVH, tail, D]
        ks, vs = [res[0]], [res[1]]
        if nfull:
            table = meta.block_tables[r.seq, :nfull].long()
            kp, vp = gather_pages(view, cache.layout.kv_dtype, table)  # [KVH, nfull, bs, D]
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
        w = self._write_steps(meta.write, cache)
        bs = cache.layout.block_size
        blocks = tail = None
        if w.blocks is not None:
            bk, bv = w.blocks.gather(cache, layer, k, v)  # [nb * bs, KVH, D]
            shape = (w.block_ids.numel(), bs) + tuple(bk.shape[1:])
            blocks = quantize_blocks(bk.view(shape), bv.view(shape), cache.layout.kv_dtype)
        res = cache.residual[:, layer]  # [S, 2, KVH, bs, D] (a view: writes land in the cache)
        # new rows only (every decode step): the C copy, after the block gathers above (row copies;
        # two index_puts cost ~0.1 ms a layer at 32 rows)
        direct = (self.native is not None and w.tail is not None and w.tail.is_new is None
                  and k.device.type == "cpu" and k.dtype == res.dtype)
        if w.tail is not None and not direct:
            tail = w.tail.gather(cache, layer, k, v)
        if blocks is not None:
            store_blocks(self._layer_view(cache, layer), w.block_ids, blocks)
        if direct:
            self.native.residual_write(k, v, w.tail.new, res[:, 0], res[:, 1], w.tail_slot, w.tail_off)
        elif tail is not None:
            res[:, 0][w.tail_slot, :, w.tail_off] = tail[0]
            res[:, 1][w.tail_slot, :, w.tail_off] = tail[1]
