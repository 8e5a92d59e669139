"""The detokenizer's host cost a token (CPU): `tokenizers`' DecodeStream against the two-decode path,
on SmolLM2's tokenizer over multilingual text with multi-byte characters split across tokens.

    python3 benchmarks/detokenize.py [--repeat 40] [--rounds 3]
"""
from __future__ import annotations

import argparse
import time

import kernels as kb  # benchmarks/kernels.py: kvmesh on the path without the install

kb._make_importable()

from kvmesh.engine.detokenizer import Detokenizer  # noqa: E402
from kvmesh.model.tokenizer import Tokenizer  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    tok = Tokenizer.from_model("smollm2")
    ids = tok.encode(TEXT * a.repeat, add_special_tokens=False)
    prompt = tok.encode("Say something:")
    print(f"{len(ids)} tokens\n| round | DecodeStream us/token | two decodes us/token | ratio | same text |\n|---|---|---|---|---|")
    for r in range(a.rounds):
        fast, text_fast = per_token_us(tok, prompt, ids)
        slow, text_slow = per_token_us(DecodeOnly(tok), prompt, ids)
        print(f"| {r} | {fast:.2f} | {slow:.2f} | {slow / fast:.2f}x | {text_fast == text_slow} |")


if __name__ == "__main__":
    main()
