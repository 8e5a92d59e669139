"""A request body read as JSON, with every way it can be unusable answered as the client's 400."""
from __future__ import annotations

import json
import re
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from kvmesh.gateway.openai_api import ApiError

# bodies this large are parsed and walked in a thread (prompts.py checks and renders them there too)
BIG_BODY_BYTES = 1 << 20
# bytes that can decode to a UTF-16 surrogate: a \uD800-\uDFFF escape, or the raw UTF-8-like bytes of one
# (json.loads decodes bytes with surrogatepass); only bodies holding one are walked
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def unpaired_surrogate(body: Any) -> Optional[tuple[str, Optional[str]]]:
    """(what, param) of the first string of a decoded body that holds an unpaired surrogate, e.g.
    ("messages[0].content", "messages[0].content") or ("a key of logit_bias", "logit_bias"), else None.
    JSON lets "\\ud800" through; no tokenizer or UTF-8 writer takes it. Iterative: a body json.loads
    accepted may be nested deeper than the stack allows twice over."""
    todo: list = [(body, None)]
    while todo:
        x, path = todo.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the body", path
        elif isinstance(x, dict):
            for k, v in x.items():
                if isinstance(k, str) and unpaired_surrogate(k) is not None:
                    return f"a key of {path or 'the body'}", path
                todo.append((v, f"{path}.{k}" if path else k))
        elif isinstance(x, list):
            todo.extend((v, f"{path}[{i}]") for i, v in enumerate(x))
    return None


def loads_in_turns(raw: bytes) -> Any:
    """json.loads(raw), for a thread beside an event loop: the C parser holds the GIL until it is
    done (0.4-0.7 s for 50-60 MB), but with a Python hook for every object and number it passes
    through the interpreter often enough to let the loop have its turns (2.5x the time for 6.5M
    ids; a single 60 MB string is still one stretch)."""
    return json.loads(raw, object_pairs_hook=_object, parse_int=_integer, parse_float=_real)


def _object(pairs: list) -> dict:
    return dict(pairs)  # as json.loads builds it: the last of a repeated key wins


def _integer(digits: str) -> int:
    return int(digits)


def _real(text: str) -> float:
    return float(text)


async def read_json(request: web.Request, in_thread: Callable[..., Awaitable]) -> Any:
    """The body, decoded and checked; a big one in a thread (`in_thread`: `Gateway.in_thread`),
    in turns with the event loop."""
    raw = await request.read()
    try:
        if len(raw) < BIG_BODY_BYTES:
            body = json.loads(raw)
            found = lone_surrogate(raw, body)
        else:  # each alone held the loop: 0.4-0.7 s of json.loads, 70 ms of regex, 1.7 s of walk
            body, found = await in_thread(_big_body, raw, bulk=True)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    if found is not None:
        what, param = found
        raise ApiError(400, f"{what} is not valid Unicode: it holds an unpaired UTF-16 surrogate",
                       param=param, code="invalid_json")
    return body


def lone_surrogate(raw: bytes, body: Any) -> Optional[tuple[str, Optional[str]]]:
    """unpaired_surrogate(body), walked only where the bytes may hold a surrogate at all."""
    return unpaired_surrogate(body) if _MAYBE_SURROGATE.search(raw) else None


def _big_body(raw: bytes) -> tuple[Any, Optional[tuple[str, Optional[str]]]]:
    body = loads_in_turns(raw)
    return body, lone_surrogate(raw, body)
