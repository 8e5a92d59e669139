"""kvmesh: disaggregated LLM serving over a quantized, paged, prefix-shared KV cache.

`from kvmesh import LLM, SamplingParams` is the offline API; it loads torch lazily so that the
light parts (gateway, hashing, index) import without it.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from kvmesh.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from kvmesh.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
