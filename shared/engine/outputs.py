"""What the engine hands back: per-step request outputs, logprobs, and KV exports (no torch)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # no torch where outputs only travel (a worker whose engine runs in its own process)
    from kvmesh.kv.host_copies import HostCopy


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
    shared: Optional[tuple[str, int]] = None
    """(segment, offset) where `data` lies in a shared-memory segment (`page_segments.py`)."""


class KVExport:
    """A finished sequence's KV as host bytes. Built on the engine thread without waiting for the
    device: the pages and the tail arrive by one stream-ordered copy (`kv/host_copies.py`), and the
    first read of `blocks` or `tail` waits for it. Call `ready()` from a worker thread first
    (`await asyncio.to_thread(export.ready)`) to keep an event loop free while it lands."""

    def __init__(self, hashes: list[bytes], token_ids: list[list[int]], tail_tokens: int, tail_dtype: str,
                 copy: Optional[HostCopy]) -> None:
        self.tail_tokens = tail_tokens
        """Tokens held in the residual slot (< block_size)."""
        self.tail_dtype = tail_dtype
        """Model dtype name of `tail`: fp32, fp16 or bf16."""
        self._hashes, self._token_ids, self._copy = hashes, token_ids, copy
        self._blocks: Optional[list[ExportedBlock]] = None
        self._tail = b""
        self.shared_range: Optional[tuple[int, int, int]] = None
        """(offset, pages' bytes, tail's bytes): where the pages, then the tail, land in the engine
        process's exports segment."""

    @classmethod
    def of(cls, blocks: list[ExportedBlock], tail_tokens: int, tail: bytes, tail_dtype: str) -> "KVExport":
        """An export of bytes already in host memory."""
        out = cls([b.hash for b in blocks], [b.token_ids for b in blocks], tail_tokens, tail_dtype, None)
        out._blocks, out._tail = list(blocks), tail
        return out

    def ready(self) -> "KVExport":
        """Waits for the copy (once) and returns self."""
        if self._blocks is None:
            pages = self._copy.rows(0)
            self._blocks = [ExportedBlock(h, t, d) for h, t, d in zip(self._hashes, self._token_ids, pages)]
            self._tail = self._copy.whole(1)
            self._copy = None
        return self

    def landed(self) -> bool:
        """Whether the pages' copy to host memory is done (never waits)."""
        return self._copy is None or self._copy.done()

    def wait_landed(self) -> tuple[list[bytes], list[list[int]]]:
        """Waits for the copy (raising what it met) without reading it; the blocks' (hashes, token ids)."""
        if self._copy is not None:
            self._copy.wait()
        return self._hashes, self._token_ids

    def release(self) -> None:
        """Its pages have been read: an export whose pages are views into a shared range gives the
        range back (`RemoteExport`); here nothing to do."""

    def pages(self) -> tuple[list[bytes], list[list[int]], memoryview, bytes]:
        """(hashes, token ids, every page's bytes back to back, the tail) without a bytes object a
        page: for a writer that sends the pages on whole (the engine process). Waits for the copy."""
        if self._copy is not None:
            return self._hashes, self._token_ids, self._copy.buffer(0), self._copy.whole(1)
        self.ready()
        return self._hashes, self._token_ids, memoryview(b"".join(b.data for b in self._blocks)), self._tail

    @property
    def blocks(self) -> list[ExportedBlock]:
        """Every full block of the sequence (prompt + computed output tokens), in order."""
        return self.ready()._blocks

    @property
    def tail(self) -> bytes:
        """Residual slot bytes [layers, 2, kv_heads, block_size, head_dim] in `tail_dtype`."""
        return self.ready()._tail


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
