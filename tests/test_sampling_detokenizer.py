"""Incremental detokenization with SmolLM2's real tokenizer: the streamed text equals a full decode
(multi-byte characters split across tokens included), and stop strings spanning tokens cut exactly."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer

from kvmesh.engine.detokenizer import _CONTEXT, DecodeStream, Detokenizer
from kvmesh.model.tokenizer import Tokenizer

TEXT = ("Größe: 42 km² — naïve café ☕ 東京タワー 🚀🚀 done.\nSecond line: ünïcödé and emoji 👩‍💻 end")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_model("smollm2")


def test_incremental_text_equals_full_decode(tok):
    prompt = tok.encode("Say something:")
    ids = tok.encode(" " + TEXT, add_special_tokens=False)
    d = Detokenizer(tok, prompt, None, False, True)
    seen = []
    for t in ids:
        assert d.add_token(t) is None
        seen.append(d.visible_text(False))
        assert "\ufffd" not in seen[-1]
    d.flush()
    assert d.text == tok.decode(ids)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # never takes text back


@pytest.mark.parametrize("stop,include", [("café", False), ("café", True), ("タワ", False), ("\nSecond", False)])
def test_stop_string_spanning_tokens(tok, stop, include):
    ids = tok.encode(" " + TEXT, add_special_tokens=False)
    full = tok.decode(ids)
    d = Detokenizer(tok, [1, 2], [stop, "never-there"], include, True)
    hit, n = None, 0
    for t in ids:
        n += 1
        hit = d.add_token(t)
        if hit:
            break
    assert hit == stop
    cut = full.index(stop)
    assert d.text == full[:cut + (len(stop) if include else 0)]
    assert d.visible_text(True) == d.text
    assert n < len(ids)


def test_running_text_holds_back_a_possible_stop_prefix(tok):
    d = Detokenizer(tok, [], ["STOPWORD"], False, True)
    for t in tok.encode("abc STOPW", add_special_tokens=False):
        assert d.add_token(t) is None
    assert d.text == "abc STOPW"
    assert d.visible_text(False) == d.text[:len(d.text) - len("STOPWORD") + 1]


class _DecodeOnly:
    """The tokenizer without its `tokenizers` backend: the detokenizer's two-decode path."""

    def __init__(self, tok: Tokenizer) -> None:
        self.decode = tok.decode


def test_decode_stream_and_two_decodes_agree_token_by_token(tok):
    prompt = tok.encode("Say something:")
    ids = tok.encode(" " + TEXT + " " + TEXT[::-1], add_special_tokens=False)
    fast, slow = (Detokenizer(t, prompt, ["km² —"], False, True) for t in (tok, _DecodeOnly(tok)))
    assert fast._stream is not None and slow._stream is None
    for t in ids:
        assert fast.add_token(t) == slow.add_token(t)
        assert fast.text == slow.text
    fast.flush(), slow.flush()
    assert fast.text == slow.text
    resumed = Detokenizer(tok, prompt, None, False, True)
    resumed.reset_from(prompt, ids[:40])
    assert resumed.text == tok.decode(ids[:40])[:len(resumed.text)] and resumed._stream is not None


class _Reference:
    """The detokenizer as it was before the head/tail split: the whole text one string, appended to
    and searched from the stop window's start. The differential test below holds the new one to it."""

    def __init__(self, tok, prompt, stop, include, skip) -> None:
        self._tok, self._stop, self._include, self._skip = tok, list(stop or []), include, skip
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.reset_from(prompt, [])

    def reset_from(self, prompt, output) -> None:
        self._ids = list(prompt[-_CONTEXT:])
        self._prefix_offset, self._read_offset, self.text = 0, len(self._ids), ""
        use = DecodeStream is not None and isinstance(getattr(self._tok, "backend", None), HFTokenizer)
        self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=self._skip) if use else None
        for t in output:
            self.add_token(t)

    def _windows(self):
        dec = self._tok.decode
        return (dec(self._ids[self._prefix_offset:self._read_offset], self._skip),
                dec(self._ids[self._prefix_offset:], self._skip))

    def add_token(self, token_id):
        self._ids.append(token_id)
        delta = None
        if self._stream is not None:
            try:
                delta = self._stream.step(self._tok.backend, token_id)
            except Exception:  # noqa: BLE001
                self._stream = None
        if self._stream is None:
            prefix, full = self._windows()
            delta = None if len(full) <= len(prefix) or full.endswith("\ufffd") else full[len(prefix):]
        if delta is None:
            return None
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        start = len(self.text)
        self.text += delta
        return self._check_stop(start)

    def flush(self):
        prefix, full = self._windows()
        if len(full) > len(prefix):
            start = len(self.text)
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._check_stop(start)

    def _check_stop(self, new_from):
        best = None
        for s in self._stop:
            i = self.text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self._include else self.text[:i]
        return s

    def visible_len(self, finished):
        if finished or not self._hold:
            return len(self.text)
        return max(0, len(self.text) - self._hold)


def _random_stream(tok, rng: random.Random) -> list[int]:
    """Encoded multilingual text (multi-byte characters split into byte tokens) mixed with random ids
    (special tokens included) and runs of one repeated character (stop strings across many folds)."""
    ids: list[int] = []
    while len(ids) < rng.randint(20, 160):
        r = rng.random()
        if r < 0.5:
            a = rng.randrange(len(TEXT))
            ids += tok.encode(TEXT[a:a + rng.randint(1, 30)], add_special_tokens=False)
        elif r < 0.8:
            ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 4))]
        else:
            ids += tok.encode(rng.choice("ab ☕é") * rng.randint(2, 20), add_special_tokens=False)
    return ids


def _assert_same(d: Detokenizer, ref: _Reference, rng: random.Random) -> None:
    assert d.text == ref.text
    n = len(ref.text)
    for finished in (False, True):
        assert d.visible_len(finished) == ref.visible_len(finished)
        assert d.visible_text(finished) == ref.text[:ref.visible_len(finished)]
    for _ in range(3):
        a, b = rng.randint(-3, n + 3), rng.choice([None, rng.randint(-3, n + 3)])
        assert d.text_slice(a, b) == ref.text[a:b], (a, b)


@pytest.mark.parametrize("seed", range(6))
def test_head_tail_text_matches_one_string_reference(tok, seed):
    rng = random.Random(seed)
    hits = 0
    for _ in range(60):
        ids = _random_stream(tok, rng)
        skip = rng.random() < 0.7
        full = tok.decode(ids, skip)
        # Stop strings taken from the text (so they hit, late ones after many folds) and one absent.
        starts = [rng.randrange(len(full) or 1) for _ in range(rng.randint(0, 3))]
        stops = [full[a:a + rng.randint(1, 9)] for a in starts]
        stops = [s for s in stops if s] + (["§never§"] if rng.random() < 0.3 else [])
        include, fold = rng.random() < 0.5, rng.choice([1, 3, 8, 64])
        t = tok if rng.random() < 0.7 else _DecodeOnly(tok)
        prompt = [rng.randrange(17, tok.vocab_size) for _ in range(rng.randint(0, 8))]
        d = Detokenizer(t, prompt, stops, include, skip, fold_chars=fold)
        ref = _Reference(t, prompt, stops, include, skip)
        sent = 0
        for k, x in enumerate(ids):
            if rng.random() < 0.03:  # a resume: rebuilt from the tokens so far
                d.reset_from(prompt, ids[:k]), ref.reset_from(prompt, ids[:k])
                sent = 0
            hit = d.add_token(x)
            assert hit == ref.add_token(x)
            hits += hit is not None
            _assert_same(d, ref, rng)
            end = ref.visible_len(hit is not None)
            assert d.text_slice(sent, end) == ref.text[sent:end]  # the streamed delta, as sequence.py
            sent = max(sent, end)
        d.flush(), ref.flush()
        _assert_same(d, ref, rng)
    assert hits > 20  # the stop path ran, not only the appends
