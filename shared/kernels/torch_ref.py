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
from kvmesh.kv.quant import dequantize_layer, quantize_blocks, store_blocks

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
        token; rows past a sequence's own count are masked). Writes into out."""
        L = cache.layout
        bs, KVH, D = L.block_size, L.kv_heads, L.head_dim
        H = q.shape[1]
        dev = q.device
        qsl = meta.query_start_loc.long()
        p = meta.prefix_lens.long()[idx]  # [G]
        qs = qsl[idx]  # [G]
        n = qsl[idx + 1] - qs  # [G]
        slot = meta.residual_slots.long()[idx]  # [G]
        G = idx.numel()
        ctx = p + torch.clamp(n, max=j1)  # keys any of these queries may see
        L_max = int(ctx.max())
        full = p // bs  # [G] full pages in the prefix
        nfull = int(full.max())

        # Context sources: cat(dequantized pages [G * nfull * bs], residual tails [G * bs], new rows [T])
        if nfull:
            table = meta.block_tables[idx, :nfull].long()  # [G, nfull]
            pk, pv = dequantize_layer(cache.layer_view(layer), table.clamp(min=0).flatten(), L.kv_dtype)
            pk = pk.transpose(1, 2).reshape(-1, KVH, D)  # [G * nfull * bs, KVH, D]
            pv = pv.transpose(1, 2).reshape(-1, KVH, D)
        else:
            pk = pv = torch.empty(0, KVH, D, device=dev)
        res = cache.residual[slot, layer].float()  # [G, 2, KVH, bs, D]
        rk = res[:, 0].transpose(1, 2).reshape(-1, KVH, D)  # [G * bs, KVH, D]
        rv = res[:, 1].transpose(1, 2).reshape(-1, KVH, D)
        src_k = torch.cat([pk, rk, k.float()])
        src_v = torch.cat([pv, rv, v.float()])
        res_base, new_base = pk.shape[0], pk.shape[0] + rk.shape[0]

        g = torch.arange(G, device=dev)[:, None]  # [G, 1]
        pos = torch.arange(L_max, device=dev)[None, :]  # [1, L_max]
        page_row = g * nfull * bs + pos
        res_row = res_base + g * bs + pos % bs
        new_row = new_base + qs[:, None] + (pos - p[:, None])
        in_pages = pos < (full * bs)[:, None]
        in_res = pos < p[:, None]
        key_row = torch.where(in_pages, page_row, torch.where(in_res, res_row, new_row))  # [G, L_max]
        key_row = key_row.clamp(0, src_k.shape[0] - 1)
        K = src_k[key_row]  # [G, L_max, KVH, D]
        V = src_v[key_row]

        j = torch.arange(j0, j1, device=dev)[None, :]  # [1, Qn]
        q_valid = j < n[:, None]  # [G, Qn]
        q_row = torch.where(q_valid, qs[:, None] + j, torch.zeros_like(j))  # [G, Qn]
        Q = q[q_row].float().view(G, j1 - j0, KVH, H // KVH, D)  # [G, Qn, KVH, R, D]

        scores = torch.einsum("gqkrd,glkd->gkrql", Q, K) * scale  # [G, KVH, R, Qn, L_max]
        allowed = pos[:, None, :] <= (p[:, None] + j)[:, :, None]  # [G, Qn, L_max] causal + own length
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("gkrql,glkd->gqkrd", probs, V).reshape(G, j1 - j0, H, D)  # [G, Qn, H, D]
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
