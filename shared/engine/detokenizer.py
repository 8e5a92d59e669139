"""Incremental detokenization and stop-string matching for one sequence (no torch).

Decoding only the newest tokens against a few tokens of context keeps each step O(1) in the
sequence length, while multi-byte characters split across tokens are held back until complete.
With a `tokenizers` backend the decoding runs in `tokenizers.decoders.DecodeStream` (the same
prefix/read-offset scheme, one call a token: 1.1-1.5 against 2.3 µs for SmolLM2's tokenizer,
`benchmarks/detokenize.py`); the offsets are kept here too, for `flush` and a stream that fails.

The text is kept as a committed head plus a short tail: `self.text += delta` on an attribute copies
the whole string every token (CPython's in-place concat only applies to locals), so a long
completion paid ~8 µs a token at 147K characters. Appends copy only the tail, the head grows once
per `fold_chars` characters, and stop strings are searched only in the window a new match can use.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

from tokenizers import Tokenizer as HFTokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # an older tokenizers: the two-decode path below
    DecodeStream = None

_CONTEXT = 5  # prompt tokens decoded as context so the first output token gets its leading space right
_FOLD_CHARS = 4096  # tail length past which it folds into the head: tail copies stay small, head copies rare


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], stop: Optional[list[str]],
                 include_stop_str_in_output: bool, skip_special_tokens: bool, *,
                 fold_chars: int = _FOLD_CHARS) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._skip = skip_special_tokens
        self._stop = list(stop or [])
        self._include_stop = include_stop_str_in_output
        # While running, hold back text that may be the start of a stop string.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._fold = fold_chars
        self._head, self._tail = "", ""  # the text is head + tail; only the tail grows per token
        self._stream = self._new_stream()

    def _new_stream(self):
        if DecodeStream is None or not isinstance(getattr(self._tok, "backend", None), HFTokenizer):
            return None
        return DecodeStream(ids=list(self._ids), skip_special_tokens=self._skip)

    def reset_from(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Rebuild from scratch (after a resume with already generated tokens)."""
        self._ids = list(prompt_token_ids[-_CONTEXT:])
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._head, self._tail = "", ""
        self._stream = self._new_stream()
        for t in output_token_ids:
            self.add_token(t)

    def add_token(self, token_id: int) -> Optional[str]:
        """Append one token; returns the stop string it completed, if any (text is then cut)."""
        self._ids.append(token_id)
        delta = None
        if self._stream is not None:
            try:
                delta = self._stream.step(self._tok.backend, token_id)
            except Exception:  # noqa: BLE001 - the stream refused a prefix: decode as below from now on
                self._stream = None
        if self._stream is None:
            delta = self._delta()
        if delta is None:
            return None  # incomplete character: wait for more bytes
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._append(delta)

    @property
    def text(self) -> str:
        """The whole text so far (O(length): prefer `text_slice` for a piece of it)."""
        return self._head + self._tail if self._tail else self._head

    def text_slice(self, start: Optional[int], end: Optional[int]) -> str:
        """`text[start:end]`, copying only the slice (the streamed delta lies near the end)."""
        h = len(self._head)
        if start is not None and end is not None and h <= start <= end:
            return self._tail[start - h:end - h]  # the streaming case, kept cheap
        start, end, _ = slice(start, end).indices(h + len(self._tail))
        if end <= start:
            return ""
        if start >= h:
            return self._tail[start - h:end - h]
        if end <= h:
            return self._head[start:end]
        return self._head[start:] + self._tail[:end - h]

    def _append(self, delta: str) -> Optional[str]:
        """Add new text; returns the stop string it completed, if any (the text is then cut)."""
        tail = self._tail
        if len(tail) > self._fold:
            # A head copy once per fold_chars characters instead of a whole-text copy every token.
            self._head += tail
            tail = ""
        new_from = len(tail)
        self._tail = tail = tail + delta  # copies the tail only: at most ~fold_chars plus one delta
        if not self._stop:
            return None
        # Only a match ending in the new text is new, so it starts at most hold (longest stop - 1)
        # characters before it: search from there, in the tail in place unless that reaches the head.
        lead = 0
        if new_from < self._hold:  # the window reaches into the head (just after a fold): copy its end
            window = self._head[max(0, len(self._head) - self._hold + new_from):] + tail
            lead = len(window) - len(tail)
        else:
            window = tail
        best: Optional[tuple[int, str]] = None
        for s in self._stop:
            i = window.find(s, max(0, lead + new_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        cut = i - lead + (len(s) if self._include_stop else 0)  # a tail index, < 0 in the head
        if cut >= 0:
            self._tail = tail[:cut]
        else:  # a stop string across the fold, kept out of the output: once, at the end
            self._head, self._tail = self._head[:len(self._head) + cut], ""
        return s

    def _windows(self) -> tuple[str, str]:
        """(text up to the read offset, text up to the last token), both from the prefix offset."""
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        return prefix, self._tok.decode(self._ids[self._prefix_offset:], self._skip)

    def _delta(self) -> Optional[str]:
        """The text the last token completes (two decodes over the offsets), or None."""
        prefix, full = self._windows()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        return full[len(prefix):]

    def flush(self) -> None:
        """At the end: emit bytes held back as an incomplete character (they will not complete)."""
        prefix, full = self._windows()
        if len(full) > len(prefix):
            self._prefix_offset = self._read_offset = len(self._ids)
            self._append(full[len(prefix):])

    def visible_len(self, finished: bool) -> int:
        """Characters of `text` safe to show: while running, a possible partial stop string is held
        back. It only grows: a stop string found later starts past what was shown."""
        n = len(self._head) + len(self._tail)
        if finished or not self._hold:
            return n
        return max(0, n - self._hold)

    def visible_text(self, finished: bool) -> str:
        return self.text_slice(0, self.visible_len(finished))
