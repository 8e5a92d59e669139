"""What `LLMEngine.add_request` refuses, with a message naming the field (an OpenAI-shaped 400 upstream)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvmesh.engine.outputs import ResumeState
from kvmesh.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """The engine's bounds a request must fit."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int


def check_request(prompt: list[int], params: SamplingParams, lim: RequestLimits,
                  resume: Optional[ResumeState]) -> int:
    """Raises ValueError for a request the engine cannot run; returns its resolved max_tokens."""
    if not prompt:
        raise ValueError("prompt_token_ids must not be empty")
    V = lim.vocab_size
    bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < V), None)
    if bad is not None:
        raise ValueError(f"prompt_token_ids: token {bad!r} is outside the vocabulary [0, {V})")
    bad = next((t for t in params.logit_bias or () if t >= V), None)
    if bad is not None:
        raise ValueError(f"logit_bias: token {bad} is outside the vocabulary [0, {V})")
    P, M = len(prompt), lim.max_model_len
    if P >= M:
        raise ValueError(f"prompt_token_ids: the prompt has {P} tokens; --max-model-len {M} leaves "
                         "no room for output")
    max_tokens = params.max_tokens if params.max_tokens is not None else M - P
    if P + max_tokens > M:
        raise ValueError(f"max_tokens: prompt ({P}) + max_tokens ({max_tokens}) exceeds "
                         f"--max-model-len {M}")
    if params.n > lim.max_num_seqs:
        raise ValueError(f"n ({params.n}) exceeds --max-num-seqs {lim.max_num_seqs}")
    bs = lim.block_size
    need = (P + max_tokens) // bs
    if need > lim.num_blocks:
        raise ValueError(f"max_tokens: prompt + max_tokens needs {need} KV blocks but the pool holds "
                         f"{lim.num_blocks}; increase --kv-cache-memory or lower max_tokens")
    if resume is not None:
        if params.n != 1:
            raise ValueError("n must be 1 for a resumed request")
        if not resume.output_token_ids:
            raise ValueError("resume.output_token_ids must hold at least the first token")
        if resume.tail_tokens != P % bs:
            raise ValueError(f"resume.tail_tokens must be {P % bs} for a {P}-token prompt at block "
                             f"size {bs}, got {resume.tail_tokens}")
    return max_tokens
