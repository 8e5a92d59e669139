"""A request body made into jobs: its prompts parsed, rendered (chat template), tokenized and checked
against the context, before anything is routed. Work on megabytes of input stays off the event loop:
long texts and id lists go through the tokenizer's GIL-free batch calls, a prompt no context could
hold is refused before it is tokenized, and a big body is checked and rendered in a thread. Inputs
longer than any prompt the context holds take the gateway's bulk threads, so that they queue behind
each other and not in front of the prompts that fit (docs/gateway.md, "A request's trip";
benchmarks/long_inputs.py)."""
from __future__ import annotations

import dataclasses
import json
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass

import jinja2
from aiohttp import web

from kvmesh.gateway.app import GATEWAY, Gateway
from kvmesh.gateway.json_body import BIG_BODY_BYTES
from kvmesh.gateway.openai_api import (ApiError, CommonRequest, parse_chat, parse_completion,
                                       parse_detokenize, parse_tokenize)
from kvmesh.model.tokenizer import GIL_FREE_CHARS

MAX_CHOICES = 256  # completions (prompts x n) one HTTP request may ask for
BULK_CHARS_A_TOKEN = 64  # a text this many characters a token of the context or longer is bulk work
BIG_BODIES_PER_SLOT = 8  # big bodies read or waiting per bulk slot: their bytes, <= 64 MiB each
BIG_RESULT_IDS = 16384  # /tokenize results this long are rendered off the loop (1M ids with strs: 1 s)


@dataclass(frozen=True)
class Job:
    """One prompt of a request, tokenized and checked."""

    ids: tuple[int, ...]
    text: str  # the prompt as text (echo)
    max_tokens: int  # sent to the worker
    score_only: bool  # echo with max_tokens 0: the worker's one token is dropped


def render_chat(gw: Gateway, messages, add_generation_prompt: bool) -> str:
    """The chat template's text; a template that rejects the conversation is the client's 400."""
    try:
        # no copies of the messages: the template's sandbox is immutable (a million messages'
        # copies were a third of what such a body took)
        return gw.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)
    except (ValueError, jinja2.TemplateError) as e:
        raise ApiError(400, str(e), param="messages") from None


async def encode(gw: Gateway, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids; long texts are encoded off the event loop so other streams keep flowing."""
    if len(text) < GIL_FREE_CHARS:  # about 1 ms per 4k chars inline; longer ones let the loop run
        return gw.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    bulk = len(text) >= gw.max_model_len * BULK_CHARS_A_TOKEN  # /tokenize of megabytes: ~0.75 s a MB
    return await gw.in_thread(gw.tokenizer.encode, text, add_special_tokens, bulk=bulk)


async def encode_prompt(gw: Gateway, text: str, common: CommonRequest, param: str,
                        add_special_tokens: bool) -> list[int]:
    """A prompt's token ids, unless its length alone shows it cannot fit the context: a 60 MB text
    took ~45 s of a core to tokenize before it was refused. (Shorter ones get the exact count.)"""
    fewest = gw.tokenizer.fewest_tokens(text)
    if fewest >= gw.max_model_len:
        check_length(gw, fewest, common, param, at_least=True)
    return await encode(gw, text, add_special_tokens)


def check_length(gw: Gateway, p: int, common: CommonRequest, param: str, at_least: bool = False) -> int:
    """The completion's max_tokens for a prompt of `p` tokens; a 400 where the two exceed the context."""
    m, asked = gw.max_model_len, common.sampling.max_tokens
    max_tokens = asked if asked is not None else m - p
    if p + max(max_tokens, 0) > m or (asked is None and p >= m):
        out = max(max_tokens, 0)
        some = "at least " if at_least else ""
        raise ApiError(400, f"This model's maximum context length is {m} tokens (--max-model-len). "
                            f"However, you requested {some}{p + out} tokens ({some}{p} in the {param}, "
                            f"{out} in the completion). Please reduce the length of the "
                            f"{param} or completion.", param=param, code="context_length_exceeded")
    return max_tokens


def make_job(gw: Gateway, ids: list[int], text: str, common: CommonRequest, param: str) -> Job:
    if not ids:
        raise ApiError(400, f"{param} is empty after tokenization", param=param)
    max_tokens = check_length(gw, len(ids), common, param)  # first: O(1), the rest reads every id
    vocab = gw.tokenizer.vocab_size
    bad_ids = [t for t in ids if t >= vocab]
    if bad_ids:
        raise ApiError(400, f"{param} holds token id {bad_ids[0]} outside the vocabulary "
                            f"(size {vocab})", param=param)
    score_only = max_tokens == 0
    return Job(ids=tuple(ids), text=text, max_tokens=1 if score_only else max_tokens,
               score_only=score_only)


@asynccontextmanager
async def body_slot(request: web.Request):
    """Held while a body of BIG_BODY_BYTES or more is parsed and made into jobs: at most
    --bulk-threads such bodies at once, the others kept as bytes meanwhile, and at most
    BIG_BODIES_PER_SLOT x as many read or waiting (more get a 429 before they are read). 61 MB of
    one-letter chat messages are ~1.1 GB parsed and rendered, so a few clients at once could take
    the gateway's memory, and every stream with it. The body is read before the slot is taken: a
    client that uploads slowly holds its own connection, not a slot."""
    gw = request.app[GATEWAY]
    length = request.content_length
    counted = length is None or length >= BIG_BODY_BYTES  # chunked: as big as it may turn out
    if counted:
        most = BIG_BODIES_PER_SLOT * gw.cfg.bulk_threads
        if gw.big_bodies >= most:
            raise ApiError(429, f"{most} bodies of 1 MB or more are being read or prepared already "
                                f"({BIG_BODIES_PER_SLOT} per --bulk-threads); retry later",
                           type="rate_limit_exceeded")
        gw.big_bodies += 1
    try:
        if len(await request.read()) < BIG_BODY_BYTES:  # aiohttp keeps the bytes for read_json
            yield
            return
        async with gw.bulk_slots:
            try:
                yield
            except BaseException as e:
                # what the refused body was parsed into lives on in the traceback's frames (until
                # the error is answered): freed here, before the next body is let in
                traceback.clear_frames(e.__traceback__)
                raise
    finally:
        if counted:
            gw.big_bodies -= 1


async def prepared(request: web.Request, fn, *args):
    """fn(*args), on a bulk thread for a body of BIG_BODY_BYTES or more (as read: a chunked upload
    has no Content-Length): its Python work on megabytes of input then takes the GIL in 5 ms turns
    with the event loop instead of holding it (a million chat messages held the loop 2.9 s)."""
    if len(await request.read()) >= BIG_BODY_BYTES:  # aiohttp keeps the body read_json read
        return await request.app[GATEWAY].in_thread(fn, *args, bulk=True)
    return fn(*args)


def chat_prompt(gw: Gateway, body) -> tuple:
    """(the parsed request, its conversation rendered by the chat template) of a chat body."""
    req = parse_chat(body)
    gw.check_model(req.common.model)
    return req, render_chat(gw, req.messages, req.add_generation_prompt)


def completion_request(gw: Gateway, body):
    """The parsed request of a completions body, its model and its count of choices checked."""
    req = parse_completion(body)
    gw.check_model(req.common.model)
    if len(req.prompts) * req.common.n > MAX_CHOICES:
        raise ApiError(400, f"{len(req.prompts)} prompts x n={req.common.n} is more than {MAX_CHOICES} "
                            "completions in one request; split the batch", param="prompt")
    return req


def ids_job(gw: Gateway, ids: list[int], common: CommonRequest, param: str) -> Job:
    """The job of a token-id prompt, checked before its text (for echo) is decoded."""
    job = make_job(gw, ids, "", common, param)
    return dataclasses.replace(job, text=gw.tokenizer.decode(ids, skip_special_tokens=False))


def tokenize_input(gw: Gateway, body) -> tuple[dict, str]:
    """(the parsed /tokenize request, the text to tokenize)."""
    req = parse_tokenize(body)
    gw.check_model(req["model"])
    if "chat" in req:
        return req, render_chat(gw, req["chat"], req["add_generation_prompt"])
    return req, req["prompt"]


def tokenized(gw: Gateway, req: dict, ids: list[int]) -> bytes:
    """The /tokenize response's JSON, its lists dumped a slice at a time: one json.dumps call holds
    the GIL throughout (~50 ms for 400k ids and strings), the event loop waiting on a thread."""
    strs = json_list(gw.tokenizer.convert_ids_to_tokens(ids)) if req["return_token_strs"] else "null"
    return (f'{{"count": {len(ids)}, "max_model_len": {gw.max_model_len}, "tokens": {json_list(ids)}, '
            f'"token_strs": {strs}}}').encode()


def json_list(items: list, slice_len: int = 16384) -> str:
    """json.dumps(items), a few milliseconds of it at a time."""
    return "[" + ", ".join(json.dumps(items[i:i + slice_len])[1:-1]
                           for i in range(0, len(items), slice_len)) + "]"


async def tokenize_response(gw: Gateway, req: dict, ids: list[int]) -> bytes:
    """tokenized(), off the event loop for a long result (the bulk threads' where no prompt is so long)."""
    if len(ids) < BIG_RESULT_IDS:
        return tokenized(gw, req, ids)
    return await gw.in_thread(tokenized, gw, req, ids, bulk=len(ids) >= gw.max_model_len)


def detokenized(gw: Gateway, body) -> bytes:
    """The /detokenize response's JSON, encoded (60 MB of text took the loop 70 ms to encode): the
    text of the body's ids."""
    tokens = parse_detokenize(body)
    gw.check_model(body.get("model"))
    vocab = gw.tokenizer.vocab_size
    if any(t >= vocab for t in tokens):
        raise ApiError(400, f"tokens holds an id outside the vocabulary (size {vocab})", param="tokens")
    return json.dumps({"prompt": gw.tokenizer.decode(list(tokens))}).encode()
