"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2) over a flattened varlen batch.

The batch is one run of T new tokens (sequence after sequence, as `AttentionMetadata.query_start_loc`
says); each layer computes q/k/v with one fused matmul, applies RoPE, lets the attention backend
attend to (cached prefix ++ new tokens) and then write the new K/V into the paged cache.
Weights are loaded by HF parameter names (`load_hf_weights`), fused as they arrive.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.kernels import gated_silu as gated_silu_kernel
from kvmesh.kernels import norm_linear
from kvmesh.kernels.backend import AttentionBackend, AttentionMetadata
from kvmesh.kernels.cpu_native import NativeKernels
from kvmesh.kernels.cpu_native import load as load_native
from kvmesh.kv.pool import KVCache
from kvmesh.model.config import ModelConfig
from kvmesh.model.native_decode import NativeDecodeStep
from kvmesh.model.packed_linear import (PackedBf16Linear, PackedGateUp, PackedLinear, onednn_bf16_packing_works,
                                        pack_linears)
from kvmesh.model.rope import RotaryEmbedding, center_keys


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.native: NativeKernels | None = None  # set by pack_for_cpu for bf16: the C RMSNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim]
        if self.native is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2:
            return self.native.rms_norm(x, self.weight, self.eps)  # F.rms_norm's numerics, one pass
        if x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] >= 64:
            # torch's fused CPU kernel is ~3x slower than these four ops on prompt-sized inputs
            # (2048 x 576: 6.4 vs 2.2 ms) and gives the same fp32 values (HF's formula)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps)))
        # one fused op (a single kernel on CUDA; statistics in float32 for half types). HF instead
        # rounds the normalized x to the model dtype before the weight: in bf16 the two differ by
        # about one bf16 ulp, in fp32 not at all.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = self.d ** -0.5
        self.key_center: torch.Tensor | None = None  # [KVH, D], see kvmesh.model.key_centers
        self.native: NativeKernels | None = None  # set by pack_for_cpu for bf16: the C RoPE
        self.fused = False  # set by fuse_norm_linears: norm, qkv GEMM and RoPE in one kernel (GPU)

    def forward(self, norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, cache: KVCache, backend: AttentionBackend) -> torch.Tensor:
        """x: the layer's input [T, hidden] -> x + attention(norm(x)) [T, hidden] (in x's storage on a GPU)."""
        T = x.shape[0]
        if self.fused and norm_linear.takes(x, self.qkv_proj.weight, norm_linear.ROPE):
            qkv = norm_linear.norm_qkv_rope(x, norm.weight, norm.eps, self.qkv_proj.weight, self.qkv_proj.bias,
                                            cos, sin, self.h, self.kvh, self.key_center)  # [T, H + 2 KVH, D]
            q, k, v = qkv[:, :self.h], qkv[:, self.h:self.h + self.kvh], qkv[:, self.h + self.kvh:]
        else:
            q, k, v = self._project(norm(x), cos, sin)
        out = backend.attend(cache, self.layer, q, k, v, meta, self.scale)  # [T, H, D]
        backend.write(cache, self.layer, k, v, meta)
        return _add_linear(x, self.o_proj, out.reshape(T, self.h * self.d))

    def _project(self, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: normed hidden [T, hidden] -> q [T, H, D], k, v [T, KVH, D]; q and k rotated."""
        T = x.shape[0]
        qkv = self.qkv_proj(x).view(T, self.h + 2 * self.kvh, self.d)  # [T, H + 2 KVH, D]
        # one rotation for q and k together (fewer kernel launches per layer); with key centers
        # (FP8 and INT4 KV) the keys lose theirs in the same pass: a shift softmax ignores
        if self.native is not None and qkv.dtype == torch.bfloat16:
            qk = self.native.rope(qkv[:, :self.h + self.kvh], cos, sin)  # [T, H + KVH, D], one pass
            if self.key_center is not None:
                qk = center_keys(qk, self.key_center)
        else:
            qk = RotaryEmbedding.apply(qkv[:, :self.h + self.kvh], cos, sin, self.key_center)  # [T, H + KVH, D]
        return qk[:, :self.h], qk[:, self.h:], qkv[:, self.h + self.kvh:]


def _add_linear(residual: torch.Tensor, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """residual + lin(x); a packed linear adds in its GEMM's epilogue (PackedLinear: the same two
    ops, so fp32 values are unchanged). On a GPU the GEMM adds into the residual in place (beta 1:
    one kernel where two were; the sum is rounded once). The residual is the layer's own input
    stream, which nothing reads after this."""
    add_to = getattr(lin, "add_to", None)
    if add_to is not None:
        return add_to(x, residual)
    if (residual.is_cuda and type(lin) is nn.Linear and lin.bias is None and residual.dim() == 2
            and residual.is_contiguous() and residual.dtype == x.dtype == lin.weight.dtype):
        return residual.addmm_(x, lin.weight.t())
    return residual + lin(x)


def _gated_silu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]; one Triton launch on a GPU."""
    if gate_up.is_cuda and gated_silu_kernel.reads(gate_up):
        return gated_silu_kernel.gated_silu(gate_up)
    gate, up = gate_up.split(inter, dim=-1)  # [T, I] each
    return F.silu(gate).mul_(up)  # in place: one [T, I] buffer less


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)
        self.fused = False  # set by fuse_norm_linears: norm, gate/up GEMM and SiLU in one kernel (GPU)

    def forward(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """x: the layer's stream [T, hidden] -> x + MLP(norm(x)) [T, hidden]."""
        gate_up = self.gate_up_proj
        if self.fused and isinstance(gate_up, nn.Linear) and norm_linear.takes(x, gate_up.weight, norm_linear.SILU):
            return _add_linear(x, self.down_proj, norm_linear.norm_gate_up(x, norm.weight, norm.eps, gate_up.weight))
        silu_mul = getattr(gate_up, "silu_mul", None)  # a PackedGateUp (bf16 on the CPU)
        if silu_mul is not None:
            return _add_linear(x, self.down_proj, silu_mul(norm(x)))
        return _add_linear(x, self.down_proj, _gated_silu(gate_up(norm(x)), self.inter))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                cache: KVCache, backend: AttentionBackend) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm, x, cos, sin, meta, cache, backend)
        return self.mlp(self.post_attention_layernorm, x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None  # set by pack_for_cpu: the output head, packed
        self.native_decode: NativeDecodeStep | None = None  # set by pack_for_cpu (bf16, AMX): decode steps in C

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: KVCache, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: int [T] -> final-normed hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [T, 1, D]
        if self.native_decode is not None and self.native_decode.takes(x, meta, cache, backend):
            return self.norm(self.native_decode.run(x, cos, sin, meta, cache))  # every layer in C, same bits
        for layer in self.layers:
            x = layer(x, cos, sin, meta, cache, backend)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab], float32 (upcast) or the model dtype (greedy
        sampling reads bf16 as is: 32 x 49,152 float32 copies cost ~0.8 ms a step on the CPU)."""
        if self.logits_head is not None:
            logits = self.logits_head(hidden)
        else:
            w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, w)
        return logits.float() if upcast else logits

    def fuse_norm_linears(self, on: bool = True) -> None:
        """On a GPU, each layer's RMSNorm + qkv GEMM + RoPE and RMSNorm + gate/up GEMM + SiLU run as
        one kernel each at decode batch sizes (`kernels/norm_linear.py`); larger batches, other
        devices and fp32 keep the unfused path. Capture CUDA graphs after the call."""
        for layer in self.layers:
            layer.self_attn.fused = layer.mlp.fused = on

    def set_key_centers(self, centers: torch.Tensor | None) -> None:
        """Subtract centers[layer] [KVH, D] from every post-RoPE key (None: off); see key_centers.py."""
        for i, layer in enumerate(self.layers):
            layer.self_attn.key_center = None if centers is None else centers[i].to(
                self.embed_tokens.weight.device, self.embed_tokens.weight.dtype)

    def key_centers(self) -> torch.Tensor | None:
        """The centers in use, [L, KVH, D], or None."""
        c = [layer.self_attn.key_center for layer in self.layers]
        return None if c[0] is None else torch.stack(c)

    def pack_for_cpu(self) -> bool:
        """Pre-packs every linear weight and the output head for the CPU GEMM library: float32 for
        MKL's sgemm, bfloat16 for oneDNN, whose MLP also gets fused epilogues (see
        `packed_linear.py`). Call once, after the weights are loaded: later weight copies would not
        reach the packed copies. Returns whether it packed (False: another dtype or device, or no
        packed GEMM in this torch build)."""
        w = self.embed_tokens.weight
        if w.dtype not in (torch.float32, torch.bfloat16) or w.device.type != "cpu":
            return False
        # bf16: the C kernels (None without a C compiler: torch's ops stay) for RMSNorm, RoPE and
        # the AMX linears of decode steps
        native = load_native() if w.dtype == torch.bfloat16 else None
        if w.dtype == torch.bfloat16 and onednn_bf16_packing_works():
            for layer in self.layers:  # before pack_linears, which would pack gate_up whole
                m = layer.mlp
                m.gate_up_proj = PackedGateUp(m.gate_up_proj.weight, m.inter, native)
        if w.dtype == torch.bfloat16:
            for m in [self.norm] + [m for layer in self.layers
                                    for m in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm)]:
                m.native = native
        if not pack_linears(self, native):
            return False
        if self.lm_head is not None:
            self.logits_head = self.lm_head
        elif w.dtype == torch.float32:
            self.logits_head = PackedLinear(w, None)
        else:
            self.logits_head = PackedBf16Linear(w, None, native)
        self.native_decode = NativeDecodeStep.build(self, native)
        return True

    # -- weights --------------------------------------------------------------------------------

    def _hf_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF parameter name -> (our tensor, first row, rows): where each HF tensor lands."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        t: dict[str, tuple[torch.Tensor, int, int]] = {
            "model.embed_tokens.weight": (self.embed_tokens.weight, 0, cfg.vocab_size),
            "model.norm.weight": (self.norm.weight, 0, cfg.hidden_size),
        }
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head.weight, 0, cfg.vocab_size)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a, m = layer.self_attn, layer.mlp
            for name, first, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                t[f"{p}self_attn.{name}.weight"] = (a.qkv_proj.weight, first, rows)
                if a.qkv_proj.bias is not None:
                    t[f"{p}self_attn.{name}.bias"] = (a.qkv_proj.bias, first, rows)
            t[f"{p}self_attn.o_proj.weight"] = (a.o_proj.weight, 0, cfg.hidden_size)
            if a.o_proj.bias is not None:
                t[f"{p}self_attn.o_proj.bias"] = (a.o_proj.bias, 0, cfg.hidden_size)
            t[f"{p}mlp.gate_proj.weight"] = (m.gate_up_proj.weight, 0, cfg.intermediate_size)
            t[f"{p}mlp.up_proj.weight"] = (m.gate_up_proj.weight, cfg.intermediate_size, cfg.intermediate_size)
            t[f"{p}mlp.down_proj.weight"] = (m.down_proj.weight, 0, cfg.hidden_size)
            t[f"{p}input_layernorm.weight"] = (layer.input_layernorm.weight, 0, cfg.hidden_size)
            t[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0, cfg.hidden_size)
        return t

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Copies HF-named tensors into the (fused) parameters; raises ValueError naming any tensor
        that is missing, unexpected or of the wrong shape."""
        targets = self._hf_targets()
        seen: set[str] = set()
        for name, w in weights:
            if name not in targets:
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                    continue  # derived from the config / tied to the embedding
                raise ValueError(f"{source}: unexpected tensor {name!r}")
            dst, first, rows = targets[name]
            want = (rows,) + tuple(dst.shape[1:])
            if tuple(w.shape) != want:
                raise ValueError(f"{source}: tensor {name!r} has shape {tuple(w.shape)}, expected {want}")
            dst[first:first + rows].copy_(w)
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing:
            raise ValueError(f"{source}: missing tensors {missing[:5]}"
                             f"{' and %d more' % (len(missing) - 5) if len(missing) > 5 else ''}")
