"""Proto <-> engine dataclass conversions for the prefill and decode boundaries (no torch).

Proto3 scalars cannot be "unset", so a few zero values carry a meaning here (documented once):
    SamplingParams.max_tokens == 0         -> None (generate up to --max-model-len)
    SamplingParams.top_p == 0              -> 1.0  (0 is not a valid top_p; an unset field)
    SamplingParams.repetition_penalty == 0 -> 1.0  (likewise)
    TokenLogprob without `top`             -> top = []
`temperature` 0 is greedy, as in the engine: senders always set every field (`sampling_to_proto`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from kvmesh.engine.outputs import KVExport, ResumeState, TokenLogprob
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.wire import kvmesh_pb2 as pb


@dataclass(frozen=True)
class BlockRef:
    """A block a request can pull: its chained hash and the kvstore node that holds it ("": nowhere,
    the prefill worker's put failed)."""

    hash: bytes
    node: str


@dataclass(frozen=True)
class TailKV:
    """The partial last block of a sequence in full precision (never content-addressed)."""

    num_tokens: int
    data: bytes
    """[layers, 2, kv_heads, block_size, head_dim] in `dtype`."""
    dtype: str
    """fp32, fp16 or bf16."""


# --- sampling parameters ----------------------------------------------------------------------

def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    if p.n != 1:
        raise ValueError(f"n must be 1 across the prefill/decode boundary, got {p.n}")
    m = pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        max_tokens=p.max_tokens or 0, min_tokens=p.min_tokens, stop=list(p.stop or ()),
        stop_token_ids=list(p.stop_token_ids or ()), ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        include_stop_str_in_output=p.include_stop_str_in_output,
        repetition_penalty=p.repetition_penalty)
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.logit_bias:
        m.logit_bias.update(p.logit_bias)
    return m


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    """Returns validated params; ValueError names the bad field."""
    p = SamplingParams(
        temperature=m.temperature, top_p=m.top_p or 1.0, top_k=m.top_k, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        max_tokens=m.max_tokens or None, min_tokens=m.min_tokens,
        stop=list(m.stop) or None, stop_token_ids=list(m.stop_token_ids) or None,
        ignore_eos=m.ignore_eos, presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty, repetition_penalty=m.repetition_penalty or 1.0,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=m.include_stop_str_in_output,
        logit_bias=dict(m.logit_bias) or None)
    p.validate()
    return p


# --- log-probabilities ------------------------------------------------------------------------

def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(m: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(token_id=m.token_id, logprob=m.logprob,
                        top=[(t.token_id, t.logprob) for t in m.top])


def logprobs_to_proto(lps: Optional[Iterable[TokenLogprob]]) -> list[pb.TokenLogprob]:
    return [logprob_to_proto(lp) for lp in lps or ()]


def logprobs_from_proto(ms: Iterable[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [logprob_from_proto(m) for m in ms]


def prompt_logprobs_to_proto(lps: Optional[Sequence[Optional[TokenLogprob]]]) -> list[pb.TokenLogprob]:
    """The first prompt token has no logprob (None); on the wire position 0 is an empty
    TokenLogprob, so the list keeps one entry per prompt token."""
    out = []
    for i, lp in enumerate(lps or ()):
        if lp is None:
            if i:
                raise ValueError(f"prompt_logprobs[{i}] is None; only position 0 may be")
            out.append(pb.TokenLogprob())
        else:
            out.append(logprob_to_proto(lp))
    return out


def prompt_logprobs_from_proto(ms: Sequence[pb.TokenLogprob]) -> Optional[list[Optional[TokenLogprob]]]:
    if not ms:
        return None
    return [None] + [logprob_from_proto(m) for m in ms[1:]]


# --- blocks and tails -------------------------------------------------------------------------

def block_refs_to_proto(refs: Iterable[BlockRef]) -> list[pb.BlockRef]:
    return [pb.BlockRef(hash=r.hash, node=r.node) for r in refs]


def block_refs_from_proto(ms: Iterable[pb.BlockRef]) -> list[BlockRef]:
    out = []
    for i, m in enumerate(ms):
        if len(m.hash) != 32:
            raise ValueError(f"cached_blocks[{i}].hash must be 32 bytes, got {len(m.hash)}")
        out.append(BlockRef(hash=m.hash, node=m.node))
    return out


def tail_from_export(export: KVExport) -> TailKV:
    return TailKV(num_tokens=export.tail_tokens, data=export.tail, dtype=export.tail_dtype)


def tail_to_proto(t: TailKV) -> pb.TailKV:
    return pb.TailKV(num_tokens=t.num_tokens, data=t.data, dtype=t.dtype)


def tail_from_proto(m: pb.TailKV) -> TailKV:
    return TailKV(num_tokens=m.num_tokens, data=m.data, dtype=m.dtype)


def resume_from_prefill(reply: pb.PrefillReply, want_logprobs: bool) -> ResumeState:
    """The decode side's ResumeState from a prefill worker's reply."""
    lps = [logprob_from_proto(reply.first_logprob)] if want_logprobs and reply.HasField("first_logprob") else None
    return ResumeState(output_token_ids=[reply.first_token], tail_tokens=reply.tail.num_tokens,
                       tail=reply.tail.data, output_logprobs=lps)
