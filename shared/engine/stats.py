"""A snapshot of engine counters for metrics (vLLM's meanings; token counts, not blocks)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    """Sequences in the running batch."""
    num_waiting: int
    """Sequences waiting for admission (new or preempted)."""
    kv_cache_usage: float
    """Fraction of KV pages in use by running sequences (0..1)."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache (cumulative)."""
    prefix_cache_hits: int
    """Of those, tokens served from cached blocks (cumulative)."""
    num_preemptions: int
    """Sequences preempted for recompute (cumulative)."""
    prompt_tokens: int
    """Prompt tokens of finished-prefill requests (cumulative)."""
    generation_tokens: int
    """Tokens sampled (cumulative)."""
    num_blocks: int = 0
    """Pages in the pool."""
    computed_tokens: int = 0
    """Tokens run through the model (prefill chunks + decodes, cumulative): what prefix hits save."""
    async_steps: int = 0
    """Steps launched before the previous step's tokens were read back (async scheduling, cumulative)."""
