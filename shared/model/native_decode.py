"""`NativeDecodeStep`: the CPU serving path's bf16 decode step, every decoder layer in one C call
(`kernels/native_decode_layer.py`), where the model, the step and the cache allow it.

Why: at SmolLM2's size a decode step's layers are ~10 small calls each (norms, linears, RoPE, the
backend's attend and write), whose Python, torch dispatch and argument checks cost ~80 µs a layer,
a sixth of a batch-32 step. The C layer runs the same kernels in the same order on the same
buffers, so hidden states and cache contents are bit-identical to the layer-by-layer path (tested).

When: bf16 weights with AMX tiles on every linear (`PackedBf16Linear.amx`), the C RMSNorm, no key
centers; a step where every sequence computes one token, at most AMX_MAX_ROWS of them; the
serving backend (`TorchBackend` with its C kernels) over unquantized bf16 pages. Anything else
runs the model's own layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.kernels.cpu_native import NativeKernels
from kvmesh.model.packed_linear import AMX_MAX_ROWS


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weight pointers, in `kvmesh_decode_layer`'s order (norm1, qkv, qkv bias,
    o, o bias, norm2, gate_up, down); the tensors stay alive in the model."""

    ptrs: tuple[int | None, ...]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeDecodeStep:
    def __init__(self, model, native: NativeKernels) -> None:
        cfg = model.config
        self.native = native
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps, self.scale = float(cfg.rms_norm_eps), cfg.head_dim ** -0.5
        self.layers = []
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(_Layer((
                _ptr(layer.input_layernorm.weight), _ptr(a.qkv_proj.amx), _ptr(a.qkv_proj.bias),
                _ptr(a.o_proj.amx), _ptr(a.o_proj.bias), _ptr(layer.post_attention_layernorm.weight),
                _ptr(m.gate_up_proj.amx), _ptr(m.down_proj.amx))))
        self._first_attn = model.layers[0].self_attn
        self._views: tuple[object, int, list[tuple[int, int, int, int, int, int]]] | None = None

    @staticmethod
    def build(model, native: NativeKernels | None) -> "NativeDecodeStep | None":
        """The fused step for a packed bf16 model, or None where some layer lacks its C parts."""
        if native is None or not native.amx_ready() or not model.layers:
            return None
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            parts = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            if any(getattr(p, "amx", None) is None for p in parts):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.native is None or n.weight.dtype != torch.bfloat16 for n in norms):
                return None
        return NativeDecodeStep(model, native)

    def takes(self, x: torch.Tensor, meta, cache, backend) -> bool:
        """Whether this step runs fused: one new token per sequence, the serving backend, bf16 pages."""
        T = x.shape[0]
        return (meta.max_query_len == 1 and T == meta.num_seqs and 0 < T <= AMX_MAX_ROWS
                and x.dtype == torch.bfloat16 and getattr(backend, "native", None) is not None
                and cache.layout.kv_dtype == "bf16" and cache.residual.dtype == torch.bfloat16
                and self._first_attn.key_center is None)

    def _layer_views(self, cache) -> list[tuple[int, int, int, int, int, int]]:
        """Per layer (k pages, v pages, page stride, residual k, residual v, slot stride), once per cache."""
        if self._views is None or self._views[0] is not cache or self._views[1] != cache.pool.data_ptr():
            views = []
            for i in range(len(self.layers)):
                v = cache.layer_view(i)
                if v.k_scale is not None or v.k.stride(0) != v.v.stride(0):
                    raise ValueError("NativeDecodeStep: wants unquantized pages with one page stride")
                res = cache.residual[:, i]  # [S, 2, KVH, bs, D]
                views.append((v.k.data_ptr(), v.v.data_ptr(), v.k.stride(0), res[:, 0].data_ptr(),
                              res[:, 1].data_ptr(), res.stride(0)))
            self._views = (cache, cache.pool.data_ptr(), views)
        return self._views[2]

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta, cache) -> torch.Tensor:
        """x [T, hidden] bf16 (embeddings; updated in place), cos/sin [T, 1, D] -> x after every layer."""
        T, D, bs = x.shape[0], self.d, cache.layout.block_size
        x = x.contiguous()
        table = meta.block_tables.to(torch.int64).contiguous()  # [T, width]
        prefix = meta.prefix_lens.to(torch.int64)
        nfull, ntail = (prefix // bs).contiguous(), (prefix % bs).contiguous()
        slots = meta.residual_slots.to(torch.int64).contiguous()
        cs, sn = cos.reshape(T, D).contiguous(), sin.reshape(T, D).contiguous()
        nqkv = (self.h + 2 * self.kvh) * D
        h = torch.empty((T, self.hidden), dtype=torch.bfloat16)
        qkv = torch.empty((T, nqkv), dtype=torch.bfloat16)
        att = torch.empty((T, self.h * D), dtype=torch.bfloat16)
        mlp = torch.empty((T, self.inter), dtype=torch.bfloat16)
        step = (table.data_ptr(), table.stride(0), nfull.data_ptr(), ntail.data_ptr(), slots.data_ptr(),
                cs.data_ptr(), sn.data_ptr(), h.data_ptr(), qkv.data_ptr(), att.data_ptr(), mlp.data_ptr())
        fn, xp = self.native.decode_layer, x.data_ptr()
        for layer, (kp, vp, ps, rk, rv, ss) in zip(self.layers, self._layer_views(cache)):
            rc = fn(xp, T, self.hidden, self.h, self.kvh, D, self.inter, self.eps, self.scale, *layer.ptrs,
                    kp, vp, ps, rk, rv, ss, bs, *step)
            if rc != 0:
                raise MemoryError("NativeDecodeStep: out of memory for the attention's score buffer")
        return x
