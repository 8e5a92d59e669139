"""The physical KV pool: pages of bytes (one page = one block, all layers) plus residual slots.

    pool:     uint8 [num_blocks, block_bytes]   quantized full blocks, layout in `layout.py`
    residual: [num_slots, num_layers, 2, kv_heads, block_size, head_dim]  model dtype; the partial
              tail block of each running sequence, in full precision until it fills

A page moves between services as `pool[block_id]` (one contiguous buffer); a residual slot as
`residual[slot]`; both go to and from host bytes in batches that never wait for the stream
(`host_copies.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvmesh.kv.host_copies import HostCopy, bytes_to_device, to_device
from kvmesh.kv.layout import INT4_GROUP, INT4_HEADER, BlockLayout

STORAGE_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "int4": torch.uint8,  # two 4-bit values per byte, low nibble = even channel
}
SCALE_DTYPES = {"fp8_e4m3": torch.float32, "fp8_e5m2": torch.float32,
                "int8": torch.float16, "int4": torch.uint8}  # int4: code bytes and bf16 headers


@dataclass
class LayerView:
    """Typed views of one layer of every page (no copies)."""

    k: torch.Tensor  # [num_blocks, kv_heads, block_size, head_dim (int4: head_dim // 2)]
    v: torch.Tensor  # same
    k_scale: torch.Tensor | None  # format-specific, see layout.py; leading dim num_blocks
    v_scale: torch.Tensor | None


class KVCache:
    """Owns the pool and residual tensors; knows nothing of which sequence uses which page."""

    def __init__(self, layout: BlockLayout, num_blocks: int, num_residual_slots: int,
                 model_dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.model_dtype = model_dtype
        self.device = torch.device(device)
        self.pool = torch.zeros(num_blocks, layout.block_bytes, dtype=torch.uint8, device=self.device)
        self.residual = torch.zeros(num_residual_slots, layout.num_layers, 2, layout.kv_heads,
                                    layout.block_size, layout.head_dim, dtype=model_dtype,
                                    device=self.device)

    @property
    def num_residual_slots(self) -> int:
        return int(self.residual.shape[0])

    def layer_view(self, layer: int) -> LayerView:
        L = self.layout
        base = self.pool.view(self.num_blocks, L.num_layers, L.layer_bytes)[:, layer]  # [N, layer_bytes]
        return view_layer_bytes(L, base)

    def gather_layer(self, layer: int, block_ids: torch.Tensor) -> LayerView:
        """Typed views of a *copy* of one layer of pages `block_ids` (int64 [n]): one byte gather
        for data and scales together (faster than gathering each typed region)."""
        L = self.layout
        base = self.pool.view(self.num_blocks, L.num_layers, L.layer_bytes)[:, layer]  # [N, layer_bytes]
        return view_layer_bytes(L, base.index_select(0, block_ids))

    def residual_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual K and V of one layer as row tensors [num_slots * block_size, kv_heads, head_dim]
        (copies: residual is laid out heads-major, so rows are gathered)."""
        r = self.residual[:, layer]  # [S, 2, H, bs, D]
        k = r[:, 0].transpose(1, 2).reshape(-1, self.layout.kv_heads, self.layout.head_dim)
        v = r[:, 1].transpose(1, 2).reshape(-1, self.layout.kv_heads, self.layout.head_dim)
        return k, v

    @property
    def slot_bytes(self) -> int:
        """Bytes of one residual slot."""
        return self.residual[0].numel() * self.residual.element_size()

    def copy_out(self, block_ids: list[int], slot: int, into: Optional[torch.Tensor] = None) -> HostCopy:
        """Pages `block_ids` (in order) and residual slot `slot` on their way to host memory,
        in stream order (nothing waits; `HostCopy.rows(0)` / `.whole(1)` read them). `into`: uint8
        host memory [n * block_bytes + slot_bytes] the pages and then the slot land in (page-locked
        where the pool is on a GPU)."""
        pages = self.pool.index_select(0, to_device(block_ids, self.device))  # [n, block_bytes], a copy
        tail = self.residual[slot]
        dst: tuple = ()
        if into is not None:
            n = pages.numel()
            dst = (into[:n].view(len(block_ids), -1), into[n:].view(tail.dtype).view(tail.shape))
        return HostCopy([pages, tail.clone()], into=dst)

    def write_pages(self, block_ids: list[int], pages: list[bytes | memoryview]) -> None:
        """Writes whole pages (`layout.block_bytes` each) in one queued copy."""
        for data in pages:
            if len(data) != self.layout.block_bytes:
                raise ValueError(f"page is {len(data)} bytes, layout wants {self.layout.block_bytes}")
        if block_ids:
            src = bytes_to_device(pages, torch.uint8, (self.layout.block_bytes,), self.device)  # [n, block_bytes]
            self.pool.index_copy_(0, to_device(block_ids, self.device), src)

    def write_rows(self, block_ids: list[int], rows: torch.Tensor, picks: list[int]) -> None:
        """Writes rows[picks[i]] into page block_ids[i]. rows: uint8 host memory [n, block_bytes],
        page-locked where the pool is on a GPU: one queued copy straight out of it, no staging copy
        (the caller keeps the rows until the stream has passed it: an event recorded after this)."""
        if tuple(rows.shape) != (rows.shape[0], self.layout.block_bytes) or rows.dtype != torch.uint8:
            raise ValueError(f"rows must be uint8 [n, {self.layout.block_bytes}], got {rows.dtype} {tuple(rows.shape)}")
        if not block_ids:
            return
        src = rows.to(self.device, non_blocking=True)  # [n, block_bytes]; on the CPU the rows themselves
        if len(picks) != rows.shape[0]:
            src = src.index_select(0, to_device(picks, self.device))
        self.pool.index_copy_(0, to_device(block_ids, self.device), src)

    def write_slot(self, slot: int, data: bytes | memoryview) -> None:
        """Writes residual slot `slot` from its bytes (model dtype, [layers, 2, kv_heads, bs, head_dim])."""
        dst = self.residual[slot]
        dst.copy_(bytes_to_device([data], dst.dtype, tuple(dst.shape), self.device)[0])


def view_layer_bytes(L: BlockLayout, base: torch.Tensor) -> LayerView:
    """Typed views (no copies) of one layer's bytes of n pages, base: uint8 [n, layer_bytes]
    (rows may be strided, as in a slice of the pool)."""
    n = base.shape[0]
    dt = STORAGE_DTYPES[L.kv_dtype]
    cols = L.head_dim // 2 if L.kv_dtype == "int4" else L.head_dim
    shape = (n, L.kv_heads, L.block_size, cols)

    def region(off: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return base[:, off:off + nbytes].view(dtype)

    k = region(L.k_data_offset, L.data_bytes, dt).view(shape)
    v = region(L.v_data_offset, L.data_bytes, dt).view(shape)
    if not L.fmt.quantized:
        return LayerView(k, v, None, None)
    sd = SCALE_DTYPES[L.kv_dtype]
    ks = region(L.k_scale_offset, L.k_scale_bytes, sd)
    vs = region(L.v_scale_offset, L.v_scale_bytes, sd)
    H, bs, D = L.kv_heads, L.block_size, L.head_dim
    if L.kv_dtype == "int8":
        ks, vs = ks.view(-1, H, bs), vs.view(-1, H, bs)
    elif L.kv_dtype == "int4":
        ks, vs = ks.view(-1, H, INT4_HEADER + D), vs.view(-1, H, bs, 2, D // INT4_GROUP)
    else:
        ks, vs = ks.view(-1, H), vs.view(-1, H)
    return LayerView(k, v, ks, vs)
