"""The model runner: owns the model, the KV pool and the attention backend; turns one scheduled
batch into hidden states and the logits rows the engine needs. The only engine part that touches
device tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvmesh.config import EngineConfig
from kvmesh.engine.chunk_graphs import ChunkGraphs
from kvmesh.engine.decode_graphs import DecodeGraphs
from kvmesh.engine.inflight import TokenFeed
from kvmesh.kernels.backend import make_backend
from kvmesh.kernels.cpu_native import load as load_native
from kvmesh.kernels.torch_ref import TorchBackend
from kvmesh.kernels.metadata import NO_STAGING, SeqSlice, StagePolicy, build_attention_metadata
from kvmesh.kv.layout import BlockLayout, canonical_kv_dtype
from kvmesh.kv.pool import KVCache
from kvmesh.model.key_centers import centers_digest, centers_keys, load_or_compute
from kvmesh.model.loader import load_model, model_cache_dir

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NAMES = {v: k for k, v in _DTYPES.items()}
DEFAULT_CPU_KV_BYTES = 1 << 30


def resolve_device(cfg: EngineConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def resolve_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[cfg.dtype]


@dataclass
class StepRows:
    """Which rows of the step's hidden states get logits, and for which purpose."""

    sample_rows: list[int]
    """One row per sequence that samples a token this step (its last new token)."""
    prompt_rows: list[tuple[int, int, int]]
    """(first row, row count, sequence index in the batch) for prompt-logprob chunks."""


class ModelRunner:
    def __init__(self, cfg: EngineConfig, num_residual_slots: int) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        self.model, self.model_config = load_model(cfg.model, self.dtype, self.device)
        self.model.eval()
        if self.device.type == "cpu":
            self.model.pack_for_cpu()  # fp32 only; a no-op elsewhere
        elif cfg.fuse_norm_linears:
            self.model.fuse_norm_linears()  # before any CUDA graph is captured
        mc = self.model_config
        kv_dtype = canonical_kv_dtype(cfg.cache.kv_cache_dtype, _NAMES[self.dtype])
        self.layout = BlockLayout(num_layers=mc.num_layers, kv_heads=mc.num_kv_heads,
                                  head_dim=mc.head_dim, block_size=cfg.cache.block_size,
                                  kv_dtype=kv_dtype)
        self.key_centers_digest = ""  # names the key centers in use (pages differ between centers)
        if centers_keys(kv_dtype):  # keys centered before FP8 or INT4 stores them (model/key_centers.py)
            centers = load_or_compute(self.model, cfg.model, model_cache_dir(cfg.model))
            self.model.set_key_centers(centers)
            self.key_centers_digest = centers_digest(centers)
        # the Triton prefill dequantizes long chunks' prefixes once per layer into a workspace
        triton = self.device.type == "cuda" and cfg.attention_backend != "torch"
        self.stage_policy = StagePolicy() if triton and kv_dtype not in ("fp16", "fp32") else NO_STAGING
        self.split_mixed = triton  # a mixed step's decode rows go to the decode kernel
        num_blocks = self._num_blocks()
        self.backend = make_backend(cfg.attention_backend, self.device)
        # decode steps through CUDA graphs on a GPU with the Triton kernels; one more residual slot,
        # owned by no sequence, takes the padding rows of a graph's batch
        graphs = self.device.type == "cuda" and self.backend.name == "triton" and not cfg.enforce_eager
        self.cache = KVCache(self.layout, num_blocks, num_residual_slots + graphs, self.dtype, self.device)
        self.graphs = DecodeGraphs(self.model, self.cache, self.backend, max_seqs=cfg.scheduler.max_num_seqs,
                                   max_context=cfg.max_seq_len_to_capture,
                                   scratch_slot=num_residual_slots) if graphs else None
        if self.graphs is not None:
            self.graphs.warm_up()  # ~0.1 s a batch size (H200): no step stalls on a short capture
        # and the steps with prompt chunks through graphs of their token bucket
        self.chunk_graphs = ChunkGraphs(self.model, self.cache, self.backend, max_seqs=cfg.scheduler.max_num_seqs,
                                        max_tokens=cfg.scheduler.max_num_batched_tokens,
                                        max_context=cfg.max_seq_len_to_capture,
                                        scratch_slot=num_residual_slots) if graphs else None
        if self.chunk_graphs is not None:
            self.chunk_graphs.warm_up()
        # the C kernels (`cpu_native.py`) on the CPU: decode attention over the pool, greedy argmax
        self.native = load_native() if self.device.type == "cpu" else None
        if isinstance(self.backend, TorchBackend):
            self.backend.native = self.native  # None: torch

    @property
    def dtype_name(self) -> str:
        return _NAMES[self.dtype]

    def _num_blocks(self) -> int:
        """Pages from --kv-cache-memory (CPU default 1 GiB) or from --gpu-memory-utilization."""
        c = self.cfg.cache
        if c.kv_cache_memory is not None:
            budget = c.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Keep room for one step's activations and logits (rough upper bound).
            act = self.cfg.scheduler.max_num_batched_tokens * (
                self.model_config.vocab_size * 4 + 16 * self.model_config.intermediate_size * 4)
            act += self.stage_policy.max_bytes  # the prefill kernel's prefix workspace
            budget = int(total * c.gpu_memory_utilization) - used - act
            if budget <= 0:
                raise ValueError(f"--gpu-memory-utilization {c.gpu_memory_utilization}: no memory left "
                                 f"for the KV cache after weights ({used / 2**30:.1f} GiB used); "
                                 "raise it or lower --max-num-batched-tokens")
        else:
            budget = DEFAULT_CPU_KV_BYTES
        n = budget // self.layout.block_bytes
        if n < 1:
            raise ValueError(f"--kv-cache-memory {budget} bytes holds no KV block of "
                             f"{self.layout.block_bytes} bytes; increase it")
        return int(n)

    @torch.inference_mode()
    def execute(self, token_chunks: list[list[int]], slices: list[SeqSlice], rows: StepRows,
                feed: Optional[TokenFeed] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Runs the model over the batch. token_chunks[i]: the new tokens of slices[i] (placeholders
        where `feed` writes the tokens a step in flight sampled). Returns (sample logits
        [len(sample_rows), V] in the model dtype, per prompt chunk logits [n, V] float32). Nothing
        waits on the device here but an eager step's own host reads."""
        if self.graphs is not None and self.graphs.takes(slices, rows.sample_rows, rows.prompt_rows):
            logits = self.graphs.run([toks[0] for toks in token_chunks], slices, feed)
            if logits is not None:  # else the capture failed: eager, as every step from now on
                return logits, []
        if self.chunk_graphs is not None and self.chunk_graphs.takes(slices, rows.sample_rows, rows.prompt_rows):
            logits = self.chunk_graphs.run(token_chunks, slices, rows.sample_rows, feed)
            if logits is not None:
                return (logits if rows.sample_rows else None), []
        flat: list[int] = []
        pos: list[int] = []
        for toks, s in zip(token_chunks, slices):
            flat.extend(toks)
            pos.extend(range(s.prefix_len, s.prefix_len + s.num_new))
        input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)  # [T]
        if feed is not None:
            feed.apply(input_ids)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)  # [T]
        meta = build_attention_metadata(slices, self.layout, self.cache.num_residual_slots, self.device,
                                        self.stage_policy, self.split_mixed)
        hidden = self.model(input_ids, positions, meta, self.cache, self.backend)  # [T, hidden]
        sample_logits = self.model.compute_logits(hidden[rows.sample_rows], upcast=False) if rows.sample_rows else None
        prompt_logits = [self.model.compute_logits(hidden[r0:r0 + n]) for r0, n, _ in rows.prompt_rows]
        return sample_logits, prompt_logits

    # ---- residual slots and pages, for fork / export / import ----
    def copy_slot(self, src: int, dst: int) -> None:
        self.cache.residual[dst].copy_(self.cache.residual[src])

    def write_slot(self, slot: int, data: bytes) -> None:
        dst = self.cache.residual[slot]
        want = dst.numel() * dst.element_size()
        if len(data) != want:
            raise ValueError(f"resume.tail is {len(data)} bytes, this engine's residual slot is {want} "
                             f"(layers, 2, kv_heads, block_size, head_dim in {self.dtype_name})")
        self.cache.write_slot(slot, data)
