"""Engine flags (vLLM's names) parsed in one place for every entry point: cli, gateway, prefill, decode.

    parser = argparse.ArgumentParser(); add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args())   # -> kvmesh.config.EngineConfig

Defaults come from the config dataclasses themselves, so the flags and `EngineConfig()` never
disagree. No torch import: the gateway uses this.
"""
from __future__ import annotations

import argparse
import re

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.kv.layout import KV_CACHE_DTYPES

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """`1073741824`, `512M`, `1G`, `1.5GiB` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--kv-cache-memory: expected bytes like 512M or 2G, got {text!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the engine flags to `parser` (in their own argument group) and returns the parser."""
    e, c, s = EngineConfig(), CacheConfig(), SchedulerConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=e.model,
                   help="local HF directory, .gguf file, or `smollm2` (bundled default)")
    g.add_argument("--dtype", default=e.dtype, choices=["auto", "fp32", "fp16", "bf16"],
                   help="weight/activation dtype; auto = fp32 on the CPU, bf16 on a GPU")
    g.add_argument("--device", default=e.device, choices=["auto", "cpu", "cuda"])
    g.add_argument("--tensor-parallel-size", type=int, default=e.tensor_parallel_size)
    g.add_argument("--seed", type=int, default=e.seed, help="default sampling seed")
    g.add_argument("--attention-backend", default=e.attention_backend, choices=["auto", "torch", "triton"])
    g.add_argument("--enforce-eager", action="store_true", default=e.enforce_eager,
                   help="no CUDA graphs: decode steps launch kernel by kernel")
    g.add_argument("--max-seq-len-to-capture", type=int, default=e.max_seq_len_to_capture,
                   help="decode steps with a longer context run without CUDA graphs")
    g.add_argument("--fuse-norm-linears", default=e.fuse_norm_linears, action=argparse.BooleanOptionalAction,
                   help="GPU: RMSNorm, the GEMM and RoPE / SiLU in one kernel at small batches (default off)")
    g.add_argument("--kv-cache-dtype", default=c.kv_cache_dtype, choices=list(KV_CACHE_DTYPES))
    g.add_argument("--block-size", type=int, default=c.block_size)
    g.add_argument("--enable-prefix-caching", default=c.enable_prefix_caching,
                   action=argparse.BooleanOptionalAction)
    g.add_argument("--gpu-memory-utilization", type=float, default=c.gpu_memory_utilization)
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=c.kv_cache_memory,
                   help="KV pool size in bytes (512M, 2G, ...); default 1 GiB on the CPU")
    g.add_argument("--max-num-seqs", type=int, default=s.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=s.max_model_len)
    g.add_argument("--async-scheduling", default=s.async_scheduling, action=argparse.BooleanOptionalAction,
                   help="launch each step before the last one's tokens are read back (default: on a GPU)")
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Builds the validated EngineConfig; a bad value raises ValueError naming its flag."""
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device,
        tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        max_seq_len_to_capture=args.max_seq_len_to_capture, fuse_norm_linears=args.fuse_norm_linears,
        cache=CacheConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                          enable_prefix_caching=args.enable_prefix_caching,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory=args.kv_cache_memory),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len,
                                  async_scheduling=args.async_scheduling))
