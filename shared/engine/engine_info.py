"""EngineInfo: what a worker knows of its engine without reaching into it (identity, page layout,
model dtype), the same whether the engine runs in the worker's process or in one of its own."""
from __future__ import annotations

from dataclasses import dataclass

from kvmesh.hashing import HashContext
from kvmesh.kv.layout import BlockLayout


@dataclass(frozen=True)
class EngineInfo:
    model_id: str
    """`model_identity` of the loaded weights."""
    layout: BlockLayout
    """The page format: what kvstore blocks must match to be imported."""
    dtype_name: str
    """Model dtype name of residual tails: fp32, fp16 or bf16."""
    key_centers_digest: str = ""
    """Names the key centers FP8 and INT4 pages hold their keys around ("" when none)."""

    @classmethod
    def of(cls, engine) -> "EngineInfo":
        """Read from an `LLMEngine`."""
        return cls(engine.model_id, engine.layout, engine.runner.dtype_name,
                   getattr(engine.runner, "key_centers_digest", ""))

    def hash_context(self, cache_salt: str = "") -> HashContext:
        return HashContext(self.model_id, self.layout.kv_dtype, self.layout.block_size, cache_salt)
