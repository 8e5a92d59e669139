"""Incremental detokenization with SmolLM2's real tokenizer: the streamed text equals a full decode
(multi-byte characters split across tokens included), and stop strings spanning tokens cut exactly."""
from __future__ import annotations

import pytest

from kvmesh.engine.detokenizer import Detokenizer
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
