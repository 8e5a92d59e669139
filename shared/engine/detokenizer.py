"""Incremental detokenization and stop-string matching for one sequence (no torch).

Decoding only the newest tokens against a few tokens of context keeps each step O(1) in the
sequence length, while multi-byte characters split across tokens are held back until complete.
With a `tokenizers` backend the decoding runs in `tokenizers.decoders.DecodeStream` (the same
prefix/read-offset scheme, one call a token: 1.1-1.5 against 2.3 µs for SmolLM2's tokenizer,
`benchmarks/detokenize.py`); the offsets are kept here too, for `flush` and a stream that fails.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

from tokenizers import Tokenizer as HFTokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # an older tokenizers: the two-decode path below
    DecodeStream = None

_CONTEXT = 5  # prompt tokens decoded as context so the first output token gets its leading space right


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], stop: Optional[list[str]],
                 include_stop_str_in_output: bool, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._skip = skip_special_tokens
        self._stop = list(stop or [])
        self._include_stop = include_stop_str_in_output
        # While running, hold back text that may be the start of a stop string.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._stream = self._new_stream()

    def _new_stream(self):
        if DecodeStream is None or not isinstance(getattr(self._tok, "backend", None), HFTokenizer):
            return None
        return DecodeStream(ids=list(self._ids), skip_special_tokens=self._skip)

    def reset_from(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Rebuild from scratch (after a resume with already generated tokens)."""
        self._ids = list(prompt_token_ids[-_CONTEXT:])
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self.text = ""
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
        start = len(self.text)
        self.text += delta
        return self._check_stop(start)

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
            start = len(self.text)
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._check_stop(start)

    def _check_stop(self, new_from: int) -> Optional[str]:
        best: Optional[tuple[int, str]] = None
        for s in self._stop:
            # Only a match that ends inside the new text can be new.
            i = self.text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self._include_stop else self.text[:i]
        return s

    def visible_len(self, finished: bool) -> int:
        """Characters of `text` safe to show: while running, a possible partial stop string is held
        back. It only grows: a stop string found later starts past what was shown."""
        if finished or not self._hold:
            return len(self.text)
        return max(0, len(self.text) - self._hold)

    def visible_text(self, finished: bool) -> str:
        return self.text[:self.visible_len(finished)]
