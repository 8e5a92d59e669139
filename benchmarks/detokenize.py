"""The detokenizer's host cost a token (CPU): `tokenizers`' DecodeStream against the two-decode path,
on SmolLM2's tokenizer over multilingual text with multi-byte characters split across tokens; then
by completion length, the old whole-text `self.text += delta` against the head + tail text.

    python3 benchmarks/detokenize.py [--repeat 40] [--rounds 3] [--lengths 1024,8192,32768]
"""
from __future__ import annotations

import argparse
import statistics
import time

import kernels as kb  # benchmarks/kernels.py: kvmesh on the path without the install

kb._make_importable()

from kvmesh.engine.detokenizer import _CONTEXT, DecodeStream, Detokenizer  # noqa: E402
from kvmesh.model.tokenizer import Tokenizer  # noqa: E402

STOP = ["</answer>"]  # one stop string that never hits: its window search runs every token
TEXT = "Größe: 42 km² — naïve café ☕ 東京タワー 🚀🚀 done.\nSecond line: ünïcödé and emoji 👩‍💻 end. "


class DecodeOnly:
    """The tokenizer without its `tokenizers` backend: the detokenizer's two-decode path."""

    def __init__(self, tok: Tokenizer) -> None:
        self.decode = tok.decode


def per_token_us(tok, prompt: list[int], ids: list[int]) -> tuple[float, str]:
    t = time.perf_counter()
    d = Detokenizer(tok, prompt, None, False, True)
    for x in ids:
        d.add_token(x)
    d.flush()
    return (time.perf_counter() - t) / len(ids) * 1e6, d.text


class AttrConcat:
    """The old way, kept as the baseline: the whole text one attribute, `+=` each token (a full copy,
    CPython's in-place concat being for locals only), stop strings searched in it from the window."""

    def __init__(self, tok: Tokenizer, prompt: list[int], stop: list[str], include: bool, skip: bool) -> None:
        self._tok, self._stop = tok, stop
        self._ids = list(prompt[-_CONTEXT:])
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=skip)

    def add_token(self, token_id: int):
        self._ids.append(token_id)
        delta = self._stream.step(self._tok.backend, token_id)
        if delta is None:
            return None
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        start = len(self.text)
        self.text += delta
        best = None
        for s in self._stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def visible_len(self, finished: bool) -> int:
        return len(self.text) if finished or not self._hold else max(0, len(self.text) - self._hold)


def by_length_us(d, ids: list[int], stream: str) -> tuple[float, float, str]:
    """(µs/token over all, µs/token over the last 1,024): add_token, plus with `stream` the per-step
    streamed delta as sequence.py takes it: "attr" `text[chars:end]`, "slice" `text_slice`."""
    sent, n, mark = 0, len(ids), max(0, len(ids) - 1024)
    t0 = t1 = time.perf_counter()
    for k, x in enumerate(ids):
        if k == mark:
            t1 = time.perf_counter()
        d.add_token(x)
        if stream:
            end = d.visible_len(False)
            _ = d.text[sent:end] if stream == "attr" else d.text_slice(sent, end)
            sent = end
    t2 = time.perf_counter()
    return (t2 - t0) / n * 1e6, (t2 - t1) / (n - mark) * 1e6, d.text


def length_table(tok: Tokenizer, prompt: list[int], lengths: list[int], rounds: int) -> None:
    ids = tok.encode(TEXT * (max(lengths) // 20), add_special_tokens=False)
    assert len(ids) >= max(lengths)
    cols = [("old", AttrConcat, ""), ("new", Detokenizer, ""), ("old+delta", AttrConcat, "attr"),
            ("new+text_slice", Detokenizer, "slice"), ("new+.text[]", Detokenizer, "attr")]
    print(f"\nstop {STOP}, median of {rounds} rounds; us/token over all tokens (over the last 1,024)\n"
          "| tokens | chars | old | new | old / new | old + delta | new + text_slice | ratio "
          "| new + .text[a:b] |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for n in lengths:
        runs = {name: [] for name, _, _ in cols}
        texts = set()
        for _ in range(rounds):
            for name, cls, stream in cols:
                *us, text = by_length_us(cls(tok, prompt, STOP, False, True), ids[:n], stream)
                runs[name].append(us)
                texts.add(text)
        med = {k: [statistics.median(u[i] for u in v) for i in (0, 1)] for k, v in runs.items()}
        cell = {k: f"{a:.2f} ({b:.2f})" for k, (a, b) in med.items()}
        same = "" if len(texts) == 1 else " DIFFER"  # every way must give the same text
        print(f"| {n:,} | {len(texts.pop()):,}{same} | {cell['old']} | {cell['new']} | "
              f"{med['old'][0] / med['new'][0]:.2f}x | {cell['old+delta']} | {cell['new+text_slice']} | "
              f"{med['old+delta'][0] / med['new+text_slice'][0]:.2f}x | {cell['new+.text[]']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", default="1024,8192,32768", help="completion lengths in tokens, comma list")
    a = ap.parse_args()
    tok = Tokenizer.from_model("smollm2")
    ids = tok.encode(TEXT * a.repeat, add_special_tokens=False)
    prompt = tok.encode("Say something:")
    print(f"{len(ids)} tokens\n| round | DecodeStream us/token | two decodes us/token | ratio | same text |\n|---|---|---|---|---|")
    for r in range(a.rounds):
        fast, text_fast = per_token_us(tok, prompt, ids)
        slow, text_slow = per_token_us(DecodeOnly(tok), prompt, ids)
        print(f"| {r} | {fast:.2f} | {slow:.2f} | {slow / fast:.2f}x | {text_fast == text_slow} |")
    length_table(tok, prompt, [int(x) for x in a.lengths.split(",")], a.rounds)


if __name__ == "__main__":
    main()
