"""OpenAI response objects (chat.completion, text_completion, their stream chunks, usage, logprobs).

`ChoiceState` accumulates one choice's deltas; the builders turn states into OpenAI's JSON shapes.
Token strings for logprobs come from a `token_text(id) -> str` callable (the tokenizer's decode of
one id, special tokens kept), as vLLM shows them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from kvmesh.gateway.dispatcher import Delta

TokenText = Callable[[int], str]


@dataclass
class ChoiceState:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list] = None

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        if d.finish_reason:
            self.finish_reason = d.finish_reason
        if d.num_prompt_tokens is not None:
            self.num_prompt_tokens = d.num_prompt_tokens
            self.num_cached_tokens = d.num_cached_tokens or 0
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number, vLLM clamps the same way.
    return max(float(x), -9999.0) if not math.isnan(x) else -9999.0


def chat_logprobs(lps: list, token_text: TokenText) -> dict:
    content = []
    for lp in lps:
        tok = token_text(lp.token_id)
        content.append({
            "token": tok, "logprob": _lp(lp.logprob), "bytes": list(tok.encode()),
            "top_logprobs": [{"token": token_text(t.token_id), "logprob": _lp(t.logprob),
                              "bytes": list(token_text(t.token_id).encode())} for t in lp.top]})
    return {"content": content}


def completion_logprobs(prompt_ids: Optional[list[int]], prompt_lps: Optional[list], lps: list,
                        token_text: TokenText, start_offset: int = 0) -> dict:
    """Legacy completions logprobs. With `prompt_ids` (echo), the prompt's tokens come first and the
    first prompt token has no logprob (null), as vLLM and lm-eval expect."""
    tokens: list[str] = []
    token_logprobs: list = []
    top_logprobs: list = []
    if prompt_ids is not None:
        plps = list(prompt_lps or [])
        if len(plps) == len(prompt_ids) - 1:
            plps = [None] + plps  # the worker left out the unconditioned first token
        elif len(plps) == len(prompt_ids) and plps:
            plps[0] = None
        else:
            plps = [None] * len(prompt_ids)
        for tid, lp in zip(prompt_ids, plps):
            tokens.append(token_text(tid))
            token_logprobs.append(None if lp is None else _lp(lp.logprob))
            top_logprobs.append(None if lp is None else _top_dict(lp, token_text))
    for lp in lps:
        tokens.append(token_text(lp.token_id))
        token_logprobs.append(_lp(lp.logprob))
        top_logprobs.append(_top_dict(lp, token_text))
    offsets, pos = [], start_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _top_dict(lp, token_text: TokenText) -> dict:
    top = {token_text(t.token_id): _lp(t.logprob) for t in lp.top}
    top.setdefault(token_text(lp.token_id), _lp(lp.logprob))
    return top


def chat_response(rid: str, model: str, states: list[ChoiceState], want_logprobs: bool,
                  token_text: TokenText) -> dict:
    choices = [{"index": s.index, "message": {"role": "assistant", "content": s.text},
                "logprobs": chat_logprobs(s.logprobs, token_text) if want_logprobs else None,
                "finish_reason": s.finish_reason or "stop"} for s in states]
    p = states[0].num_prompt_tokens if states else 0
    c = states[0].num_cached_tokens if states else 0
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(p, sum(len(s.token_ids) for s in states), c)}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict,
               finish_reason: Optional[str] = None, logprobs: Optional[dict] = None,
               with_usage_field: bool = False) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                        "finish_reason": finish_reason}]}
    if with_usage_field:
        out["usage"] = None
    return out


def completion_chunk(rid: str, model: str, created: int, index: int, text: str,
                     finish_reason: Optional[str] = None, logprobs: Optional[dict] = None,
                     with_usage_field: bool = False) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": index, "text": text, "logprobs": logprobs,
                        "finish_reason": finish_reason}]}
    if with_usage_field:
        out["usage"] = None
    return out


def usage_chunk(rid: str, model: str, created: int, obj: str, u: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": u}
