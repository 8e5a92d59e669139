"""`kvmesh memory`: KV bytes per token and what fits in a memory budget, for every KV dtype.

Built on `kvmesh.kv.layout.BlockLayout`, so the numbers are the bytes the pools really allocate
(data, scales and alignment padding), not a formula kept apart from the code. No torch import.

    bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element  (+ scales)
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from kvmesh.kv.layout import BlockLayout, sequences_that_fit

REPORT_DTYPES: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
"""Canonical KV dtypes the report lists (fp8 = fp8_e4m3, auto = the model's dtype)."""

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
    "ti": 1 << 40, "tib": 1 << 40,
}


def parse_bytes(text: str, flag: str = "--memory") -> int:
    """'80GiB' -> 85899345920; '80GB' -> 80e9; '1.5TiB', '512MiB', '1024' (bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{flag}: cannot read {text!r} as a size; write e.g. 80GiB, 40GB, 512MiB or a byte count")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{flag} must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """Decimal units, as model cards and the design doc quote them (327.68 kB)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.2f} B"


@dataclass(frozen=True)
class ModelShape:
    """The three numbers the KV cache size depends on (plus a name for the report header)."""

    num_layers: int
    """--layers"""
    kv_heads: int
    """--kv-heads: KV heads (not query heads: grouped-query attention shares them)."""
    head_dim: int
    """--head-dim"""
    name: str = "custom"

    def __post_init__(self) -> None:
        for flag, value in (("--layers", self.num_layers), ("--kv-heads", self.kv_heads), ("--head-dim", self.head_dim)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")


@dataclass(frozen=True)
class MemoryRow:
    """One KV dtype's line of the report."""

    kv_dtype: str
    data_bytes_per_token: float
    scale_bytes_per_token: float
    bytes_per_token: float
    """Data plus scales plus alignment padding: what a block really costs per token."""
    block_bytes: int
    tokens: int
    """KV tokens that fit in the memory budget (whole blocks)."""
    sequences: int
    """Sequences of --seq-len tokens that fit (each rounded up to whole blocks)."""
    capacity_vs_fp16: float
    """Tokens that fit, relative to fp16 KV."""
    note: str = ""


@dataclass(frozen=True)
class MemoryReport:
    shape: ModelShape
    memory_bytes: int
    seq_len: int
    block_size: int
    rows: tuple[MemoryRow, ...]

    def row(self, kv_dtype: str) -> MemoryRow:
        for r in self.rows:
            if r.kv_dtype == kv_dtype:
                return r
        raise KeyError(kv_dtype)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def to_text(self) -> str:
        s = self.shape
        lines = [
            f"model: {s.name}  layers={s.num_layers} kv_heads={s.kv_heads} head_dim={s.head_dim}  "
            f"block_size={self.block_size}",
            f"memory: {format_bytes(self.memory_bytes)} ({self.memory_bytes} bytes)  "
            f"sequences of {self.seq_len} tokens",
            "",
            f"{'kv dtype':<10} {'data/token':>12} {'scales/token':>13} {'total/token':>12} "
            f"{'tokens':>14} {'sequences':>10} {'vs fp16':>8}",
        ]
        for r in self.rows:
            if r.note:
                lines.append(f"{r.kv_dtype:<10} {r.note}")
                continue
            lines.append(
                f"{r.kv_dtype:<10} {format_bytes(r.data_bytes_per_token):>12} "
                f"{format_bytes(r.scale_bytes_per_token):>13} {format_bytes(r.bytes_per_token):>12} "
                f"{r.tokens:>14,} {r.sequences:>10,} {r.capacity_vs_fp16:>7.2f}x")
        lines.append("")
        lines.append("kB = 1000 bytes. Total includes scales and 16-byte region alignment; the engine also "
                     "keeps each running sequence's partial last block in full precision.")
        return "\n".join(lines)


def build_report(shape: ModelShape, memory_bytes: int, seq_len: int, block_size: int = 16,
                 kv_dtypes: tuple[str, ...] = REPORT_DTYPES) -> MemoryReport:
    if seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    if memory_bytes < 1:
        raise ValueError(f"--memory must be positive, got {memory_bytes}")
    fp16 = BlockLayout(shape.num_layers, shape.kv_heads, shape.head_dim, block_size, "fp16")
    fp16_blocks = memory_bytes // fp16.block_bytes
    rows = []
    for dtype in kv_dtypes:
        try:
            layout = BlockLayout(shape.num_layers, shape.kv_heads, shape.head_dim, block_size, dtype)
        except ValueError as e:  # e.g. int4 needs head_dim divisible by 32
            rows.append(MemoryRow(dtype, 0.0, 0.0, 0.0, 0, 0, 0, 0.0, note=f"not available: {e}"))
            continue
        blocks = memory_bytes // layout.block_bytes
        rows.append(MemoryRow(
            kv_dtype=dtype,
            data_bytes_per_token=layout.data_bytes_per_token,
            scale_bytes_per_token=layout.scale_bytes_per_token,
            bytes_per_token=layout.bytes_per_token,
            block_bytes=layout.block_bytes,
            tokens=blocks * block_size,
            sequences=sequences_that_fit(layout, memory_bytes, seq_len),
            capacity_vs_fp16=(blocks / fp16_blocks) if fp16_blocks else fp16.block_bytes / layout.block_bytes,
        ))
    return MemoryReport(shape, memory_bytes, seq_len, block_size, tuple(rows))


def shape_from_model(model: str) -> ModelShape:
    """Read layers, KV heads and head_dim from an HF dir, a .gguf file or `smollm2`."""
    from kvmesh.model.config import load_model_config

    cfg = load_model_config(model)
    return ModelShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, name=cfg.name or model)
