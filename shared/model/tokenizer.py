"""Tokenizer and chat template (no torch: the gateway uses it).

From an HF directory (tokenizer.json + tokenizer_config.json / chat_template.jinja +
generation_config.json) or rebuilt from a GGUF file's metadata (byte-level BPE vocabulary, merges,
token types, bos/eos ids, chat template). Encoding is the `tokenizers` library; chat templates are
rendered with jinja2 the way transformers does (sandboxed, trim_blocks, lstrip_blocks).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from kvmesh.model.config import resolve_model_path

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# texts this long (and a quarter as many ids) go through `encode_batch_fast` / `decode_batch`, which let
# other threads run meanwhile (`encode` and `decode` hold the GIL: 1.3 s for 3 MB of text, 0.56 s for
# 3M ids, the caller's event loop stopped though it waits in a thread); callers hand such texts to a
# thread (the gateway), shorter ones are quicker inline
GIL_FREE_CHARS = 16384

# llama.cpp `tokenizer.ggml.pre` -> the split regex its merges were learned with. "smollm" (and the
# StarCoder family) split every digit alone before GPT-2's regex, as their tokenizer.json does.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")
_REGEX_PRES = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
               "qwen2": _QWEN2_SPLIT, "default": _GPT2_SPLIT, "gpt-2": _GPT2_SPLIT}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every token with it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """Encode/decode plus chat template; ids match transformers' tokenizer for the same model."""

    def __init__(self, backend: HFTokenizer, *, chat_template: str | None, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template: jinja2.Template | None = None
        self._max_token_chars: int | None = None

    # -- construction ---------------------------------------------------------------------------

    @staticmethod
    def from_model(model: str) -> "Tokenizer":
        """From an HF directory, a .gguf file, or the `smollm2` alias."""
        path = resolve_model_path(model)
        if path.is_file():
            from kvmesh.model.gguf_file import GGUFFile
            return Tokenizer.from_gguf(GGUFFile(path))
        return Tokenizer.from_hf_dir(path)

    @staticmethod
    def from_hf_dir(path: Path) -> "Tokenizer":
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"model directory {str(path)!r} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(tok_file))
        tc: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            tc = json.loads((path / "tokenizer_config.json").read_text())
        template = tc.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        bos, eos = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
        eos_ids: list[int] = []
        gen = path / "generation_config.json"
        if gen.is_file():
            e = json.loads(gen.read_text()).get("eos_token_id")
            eos_ids = [int(x) for x in (e if isinstance(e, list) else [e] if e is not None else [])]
        if eos is not None and backend.token_to_id(eos) is not None and backend.token_to_id(eos) not in eos_ids:
            eos_ids.append(backend.token_to_id(eos))
        bos_id = backend.token_to_id(bos) if bos is not None else None
        return Tokenizer(backend, chat_template=template, bos_token_id=bos_id,
                         eos_token_ids=tuple(eos_ids), bos_token=bos, eos_token=eos)

    @staticmethod
    def from_gguf(g: "GGUFFile") -> "Tokenizer":  # noqa: F821 (lazy import)
        kind = g.require("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF file {str(g.path)!r}: tokenizer model {kind!r} is not supported "
                             f"(only byte-level BPE, 'gpt2')")
        tokens: list[str] = g.require("tokenizer.ggml.tokens")
        types = list(g.get("tokenizer.ggml.token_type", []))
        merges = [tuple(m.split(" ", 1)) for m in g.require("tokenizer.ggml.merges")]
        alphabet = set(_bytes_to_unicode().values())
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = g.get("tokenizer.ggml.pre", "default")
        split = _REGEX_PRES.get(pre, _GPT2_SPLIT)
        steps = [pre_tokenizers.Digits(individual_digits=True)] if pre in _DIGIT_SPLIT_PRES else []
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        # control tokens are special (matched whole, skipped on decode); user-defined ones are
        # matched whole but kept. A "control" token outside the byte alphabet is a mislabel.
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                   if ty == _CONTROL and set(t) <= alphabet]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                if ty == _USER_DEFINED]
        backend.add_special_tokens(special)
        backend.add_tokens(user)
        bos_id = g.get("tokenizer.ggml.bos_token_id")
        bos = tokens[bos_id] if bos_id is not None else None
        if g.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        eos_ids = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            e = g.get(key)
            if e is not None and int(e) not in eos_ids:
                eos_ids.append(int(e))
        eos = tokens[eos_ids[0]] if eos_ids else None
        return Tokenizer(backend, chat_template=g.get("tokenizer.chat_template"), bos_token_id=bos_id,
                         eos_token_ids=tuple(eos_ids), bos_token=bos, eos_token=eos)

    def save(self, path: Path) -> None:
        """Writes tokenizer.json + tokenizer_config.json (what `from_hf_dir` reads back)."""
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({
            "chat_template": self.chat_template, "bos_token": self.bos_token,
            "eos_token": self.eos_token, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))

    # -- encode / decode ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < GIL_FREE_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # the _fast batch skips the offsets: half the time, and less to free with the GIL held
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) from its length alone (no token spells more characters
        than the longest vocabulary entry), for refusing texts no context could hold before spending
        seconds a MB on them; 0 where a normalizer may drop characters first."""
        if self.backend.normalizer is not None:
            return 0
        if self._max_token_chars is None:
            self._max_token_chars = max(len(self.backend.id_to_token(i) or "") for i in range(self.vocab_size))
        return len(text) // max(1, self._max_token_chars)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) < GIL_FREE_CHARS // 4:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]  # GIL-free

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def is_special(self, token_id: int) -> bool:
        tok = self.backend.get_added_tokens_decoder().get(int(token_id))
        return bool(tok is not None and tok.special)

    # -- chat template --------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Renders the model's chat template to text (encode it with add_special_tokens=False)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a completion request instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     **kwargs)


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


