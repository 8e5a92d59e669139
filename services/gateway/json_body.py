"""A request body read as JSON, with every way it can be unusable answered as the client's 400."""
from __future__ import annotations

import json
import re
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from kvmesh.gateway.openai_api import ApiError

BIG_BODY_BYTES = 1 << 20  # bodies this large are walked in a thread (prompts.py checks and renders them there too)
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


async def read_json(request: web.Request, in_thread: Callable[..., Awaitable]) -> Any:
    """The body, decoded; a big one's strings are walked through `in_thread` (`Gateway.in_thread`)."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    if _MAYBE_SURROGATE.search(raw):
        # a walk of every string: 1.7 s for a million messages, so a big body's walk takes turns with
        # the event loop from a thread
        found = unpaired_surrogate(body) if len(raw) < BIG_BODY_BYTES else await in_thread(
            unpaired_surrogate, body, bulk=True)
        if found is not None:
            what, param = found
            raise ApiError(400, f"{what} is not valid Unicode: it holds an unpaired UTF-16 surrogate",
                           param=param, code="invalid_json")
    return body
