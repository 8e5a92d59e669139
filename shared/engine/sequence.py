"""A sequence (one completion being generated) and the request that groups its n completions.

The scheduler works on sequences; outputs are reported per request. KV state of a sequence is an
opaque list of block ids from the KVCacheManager plus a residual slot for its partial tail block.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvmesh.engine.detokenizer import Detokenizer
from kvmesh.engine.outputs import CompletionOutput, KVExport, OutputKind, ResumeState, TokenLogprob
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.hashing import hash_block


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, request: "Request", index: int, detok: Detokenizer,
                 generator: Optional[torch.Generator]) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        """Tokens whose K/V are in the cache (full pages + residual slot)."""
        self.block_ids: list[int] = []
        """Pages held for this sequence, in order (ref-counted by the KVCacheManager)."""
        self.num_cached_blocks = 0
        """Leading blocks of block_ids that are registered in the prefix cache."""
        self.residual_slot: Optional[int] = None
        self.status = Status.WAITING
        self.generator = generator
        self.device_tensors: dict = {}
        """What the sampler makes once of this request's params on the device (its logit bias)."""
        self.detok = detok
        self.logprobs: Optional[list[TokenLogprob]] = [] if request.params.logprobs is not None else None
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None
        self.num_preemptions = 0
        self.resume_tail: Optional[tuple[int, bytes]] = None
        """(tokens, bytes) to load into the residual slot when a resumed sequence starts."""
        self.sent_tokens = 0
        self.sent_chars = 0
        """Output tokens and visible characters a DELTA request's outputs have carried."""
        self.block_hashes: list[bytes] = []
        """Chained hashes of every full block of token_ids (computed or not)."""
        self.pending = 0
        """Tokens sampled by steps still in flight (async scheduling): they follow token_ids, known
        on the device only until `engine.LLMEngine` reads them back."""
        self.stops_after_pending = False
        """Its last pending token ends it by length: the scheduler gives it no further step."""
        self._extend_hashes()

    def _extend_hashes(self) -> None:
        bs = self.request.block_size
        parent = self.block_hashes[-1] if self.block_hashes else self.request.hash_seed
        for b in range(len(self.block_hashes), len(self.token_ids) // bs):
            parent = hash_block(parent, self.token_ids[b * bs:(b + 1) * bs])
            self.block_hashes.append(parent)

    def append_tokens(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        if len(self.token_ids) // self.request.block_size > len(self.block_hashes):
            self._extend_hashes()

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Known tokens plus pending ones: what the scheduler computes and allocates pages for."""
        return len(self.token_ids) + self.pending

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        """Still computing tokens it already knows (prompt, or outputs after a recompute)."""
        return self.num_computed_tokens < self.num_tokens - 1

    def completion(self, delta: bool = False) -> CompletionOutput:
        """The completion so far, or (delta) only what is new since the last delta."""
        finished = self.finish_reason is not None
        text_end = self.detok.visible_len(finished)
        tokens, chars = (self.sent_tokens, self.sent_chars) if delta else (0, 0)
        out = CompletionOutput(
            index=self.index, text=self.detok.text_slice(chars, text_end),
            token_ids=self.token_ids[self.num_prompt_tokens + tokens:],  # a slice: a list of its own
            logprobs=self.logprobs[tokens:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        if delta:
            self.sent_tokens, self.sent_chars = self.num_output_tokens, text_end
        return out


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """Resolved: params.max_tokens or what --max-model-len leaves."""
    block_size: int
    hash_seed: bytes
    """Seed of the block hash chain (model, KV dtype, block size, cache salt)."""
    cache_salt: str = ""
    export_kv: bool = False
    hand_off: bool = False
    """The run stops at max_tokens only to hand the sequence on (a prefill hop): another engine resumes
    it, so bytes of an incomplete last character stay held back."""
    resume: Optional[ResumeState] = None
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    """True once the first sequence has been forked into n (after its prefill)."""
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    error: Optional[str] = None
    kv_export: Optional[KVExport] = None
    reserved_slots: list[int] = field(default_factory=list)
    """Residual slots held for the n - 1 completions forked after prefill."""
    output_kind: OutputKind = OutputKind.CUMULATIVE
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return (self.forked or self.params.n == 1) and all(s.is_finished for s in self.seqs)

    @property
    def skip_prefix_cache(self) -> bool:
        """prompt_logprobs needs logits at every prompt position, so nothing may be served cached."""
        return self.params.prompt_logprobs is not None
