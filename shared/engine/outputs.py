"""What the engine hands back: per-step request outputs, logprobs, and KV exports (no torch)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class OutputKind(enum.Enum):
    """How much of a request each `RequestOutput` carries (`LLMEngine.add_request`)."""

    CUMULATIVE = "cumulative"
    """Everything so far, every step: each output copies the whole completion (O(length) a step)."""
    DELTA = "delta"
    """Only what is new since the request's last output: tokens, text, logprobs; prompt logprobs in
    the first output. A stream's cost a step stays flat as completions grow."""
    FINAL_ONLY = "final_only"
    """Nothing until the request finishes, then the cumulative output."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """The most likely (token id, logprob) pairs at this position, best first."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]]
    finish_reason: Optional[str]
    """"stop" | "length" | "abort" | None (still running)."""
    stop_reason: Optional[object] = None
    """The stop string or stop token id that ended it (None for EOS or length)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ExportedBlock:
    hash: bytes
    token_ids: list[int]
    data: bytes
    """One page: `KVCache.pool[block_id]` bytes, layout in kvmesh.kv.layout."""


@dataclass
class KVExport:
    blocks: list[ExportedBlock]
    """Every full block of the sequence (prompt + computed output tokens), in order."""
    tail_tokens: int
    """Tokens held in the residual slot (< block_size)."""
    tail: bytes
    """Residual slot bytes [layers, 2, kv_heads, block_size, head_dim] in `tail_dtype`."""
    tail_dtype: str
    """Model dtype name of `tail`: fp32, fp16 or bf16."""


@dataclass
class ResumeState:
    """What a decode worker needs to continue a sequence another engine prefilled."""

    output_token_ids: list[int]
    """Tokens already generated (at least the first one); generation continues after them."""
    tail_tokens: int
    tail: bytes
    output_logprobs: Optional[list[TokenLogprob]] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]]
    """One per prompt token; the first is None (nothing predicts it)."""
    kv_export: Optional[KVExport] = None
    error: Optional[str] = None
    """Set when the request failed inside the engine (others keep running)."""


def merge_delta(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Two DELTA outputs of one request as one (what both steps added, in order). Mutates and
    returns `older`, which the caller owns (the engine builds fresh outputs every step)."""
    by_index = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        o = by_index.get(c.index)
        if o is None:  # a completion forked after `older` (n > 1)
            older.outputs.append(c)
            continue
        o.text += c.text
        o.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            o.logprobs = (o.logprobs or []) + c.logprobs
        if c.finish_reason is not None:
            o.finish_reason, o.stop_reason = c.finish_reason, c.stop_reason
    older.outputs.sort(key=lambda c: c.index)
    older.finished = newer.finished
    older.num_cached_tokens = newer.num_cached_tokens
    if older.prompt_logprobs is None:  # DELTA sends them once, with the first output
        older.prompt_logprobs = newer.prompt_logprobs
    older.kv_export = newer.kv_export or older.kv_export
    return older
