"""`TorchBackend`: the pure-torch attention backend (the CPU serving path and the kernels' reference).

attend: for each sequence, its context = dequantized full pages ++ residual tail ++ its new K/V;
causal attention with GQA, softmax and accumulation in float32. Decode sequences (one new token)
are batched together, padded to the longest context and masked; a longer query run is attended
sequence by sequence (in query chunks, to bound the score matrix).
write: follows the `WritePlan` (gather rows of cat(residual, new), quantize completed blocks into
their pages, copy leftovers into the residual slots). All gathers happen before any write, since a
leftover may land on a residual row that a completed block just consumed.
"""
from __future__ import annotations

import torch

from kvmesh.kernels.backend import AttentionMetadata
from kvmesh.kv.pool import KVCache
from kvmesh.kv.quant import dequantize, quantize_blocks, store_blocks

QUERY_CHUNK = 512  # query rows per score matrix for long prefills: [chunk, ctx] per head


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


def _page_scores(Q: torch.Tensor, pk: torch.Tensor) -> torch.Tensor:
    """Q [G, KVH, M, D] x pages pk [G, nfull, KVH, bs, D] -> scores [G, KVH, M, nfull * bs].
    Few query rows (decode): broadcast Q over the pages instead of copying the pages heads-major."""
    G, nfull, KVH, bs, D = pk.shape
    M = Q.shape[2]
    if M < bs:
        s = torch.matmul(Q[:, None], pk.transpose(-1, -2))  # [G, nfull, KVH, M, bs]
        return s.permute(0, 2, 3, 1, 4).reshape(G, KVH, M, nfull * bs)
    k = pk.transpose(1, 2).reshape(G, KVH, nfull * bs, D)
    return torch.matmul(Q, k.transpose(-1, -2))


def _page_output(P: torch.Tensor, pv: torch.Tensor) -> torch.Tensor:
    """probs P [G, KVH, M, nfull * bs] x pages pv [G, nfull, KVH, bs, D] -> [G, KVH, M, D]."""
    G, nfull, KVH, bs, D = pv.shape
    M = P.shape[2]
    if M < bs:
        p = P.reshape(G, KVH, M, nfull, bs).permute(0, 3, 1, 2, 4)  # [G, nfull, KVH, M, bs]
        return torch.matmul(p, pv).sum(dim=1)
    return torch.matmul(P, pv.transpose(1, 2).reshape(G, KVH, nfull * bs, D))


class TorchBackend:
    """Implements `kvmesh.kernels.backend.AttentionBackend` with plain torch ops on any device."""

    name = "torch"

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)  # [T, H, D]
        n_new = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()  # [B]
        decode = torch.nonzero(n_new == 1).flatten()
        if decode.numel():
            self._attend_group(cache, layer, q, k, v, meta, scale, decode, out, 0, 1)
        for i in torch.nonzero(n_new > 1).flatten().tolist():
            seq = torch.tensor([i], device=q.device)
            n = int(n_new[i])
            for j0 in range(0, n, QUERY_CHUNK):
                self._attend_group(cache, layer, q, k, v, meta, scale, seq, out, j0, min(n, j0 + QUERY_CHUNK))
        return out

    def _attend_group(self, cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, meta: AttentionMetadata, scale: float, idx: torch.Tensor,
                      out: torch.Tensor, j0: int, j1: int) -> None:
        """Attention for sequences `idx` [G], query rows j0..j1-1 of each (relative to its first new
        token; rows past a sequence's own count are masked). Writes into out.

        Keys come in three parts with their own masks, scored separately and softmaxed together
        (attention does not depend on key order): full pages [G, KVH, nfull * bs], the residual
        tail [G, KVH, bs] and the new rows [G, KVH, j1]. No gather of one big padded context."""
        L = cache.layout
        bs, KVH, D = L.block_size, L.kv_heads, L.head_dim
        H = q.shape[1]
        R = H // KVH
        dev = q.device
        qsl = meta.query_start_loc.long()
        p = meta.prefix_lens.long()[idx]  # [G]
        qs = qsl[idx]  # [G]
        n = qsl[idx + 1] - qs  # [G]
        slot = meta.residual_slots.long()[idx]  # [G]
        G, Qn = idx.numel(), j1 - j0
        full = p // bs  # [G] full pages in the prefix
        nfull = int(full.max())

        j = torch.arange(j0, j1, device=dev)[None, :]  # [1, Qn]
        q_valid = j < n[:, None]  # [G, Qn]
        q_row = torch.where(q_valid, qs[:, None] + j, torch.zeros_like(j))  # [G, Qn]
        Q = q[q_row].float().view(G, Qn, KVH, R, D).permute(0, 2, 3, 1, 4).reshape(G, KVH, R * Qn, D)
        Q = Q * scale

        keys: list[torch.Tensor] = []  # each [G, KVH, Lpart, D]
        vals: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []  # each [G, Qn, Lpart] bool (True = may attend)
        page_k = page_v = None
        if nfull:
            table = meta.block_tables[idx, :nfull].long()  # [G, nfull]
            pages = cache.gather_layer(layer, table.clamp(min=0).flatten())  # one byte gather
            pk, pv = dequantize(pages.k, pages.v, pages.k_scale, pages.v_scale, L.kv_dtype)
            page_k = pk.view(G, nfull, KVH, bs, D)
            page_v = pv.view(G, nfull, KVH, bs, D)
            page_pos = torch.arange(nfull * bs, device=dev)[None, :] < (full * bs)[:, None]  # [G, nfull*bs]
            masks.append(page_pos[:, None, :].expand(G, Qn, nfull * bs))
        res = cache.residual[slot, layer].float()  # [G, 2, KVH, bs, D]
        keys.append(res[:, 0])
        vals.append(res[:, 1])
        res_pos = torch.arange(bs, device=dev)[None, :] < (p % bs)[:, None]  # [G, bs]
        masks.append(res_pos[:, None, :].expand(G, Qn, bs))
        jn = torch.arange(j1, device=dev)[None, :]  # [1, j1] new keys this chunk can see
        n_row = torch.where(jn < n[:, None], qs[:, None] + jn, torch.zeros_like(jn))  # [G, j1]
        keys.append(k[n_row].float().permute(0, 2, 1, 3))  # [G, KVH, j1, D]
        vals.append(v[n_row].float().permute(0, 2, 1, 3))
        # causal among the new tokens (j < n implies jn < n for every key a query may see)
        masks.append((jn[:, None, :] <= j[:, :, None]).expand(G, Qn, j1))

        parts = [torch.matmul(Q, kk.transpose(-1, -2)) for kk in keys]
        if page_k is not None:
            parts.insert(0, _page_scores(Q, page_k))
        scores = torch.cat(parts, dim=-1)  # [G, KVH, R*Qn, Ltot]
        allowed = torch.cat(masks, dim=-1)  # [G, Qn, Ltot]
        allowed = allowed[:, None, None].expand(G, KVH, R, Qn, allowed.shape[-1]).reshape(G, KVH, R * Qn, -1)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        o = torch.zeros(G, KVH, R * Qn, D, device=dev)
        at = 0
        if page_v is not None:
            at = nfull * bs
            o += _page_output(probs[..., :at], page_v)
        for vv in vals:
            o += torch.matmul(probs[..., at:at + vv.shape[2]], vv)
            at += vv.shape[2]
        o = o.view(G, KVH, R, Qn, D).permute(0, 3, 1, 2, 4).reshape(G, Qn, H, D)  # [G, Qn, H, D]
        out[q_row[q_valid]] = o[q_valid].to(out.dtype)

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
