"""Server-sent events as OpenAI streams them: `data: <json>\n\n` per chunk, then `data: [DONE]\n\n`."""
from __future__ import annotations

import json

from aiohttp import web

DONE = b"data: [DONE]\n\n"
# a request's key once its event stream is prepared (its status sent); a typed key where aiohttp has them
STREAM_OPEN = web.RequestKey("kvmesh.stream_open", bool) if hasattr(web, "RequestKey") else "kvmesh.stream_open"


def event(obj: dict) -> bytes:
    """One SSE event; compact JSON keeps non-ASCII text as is (UTF-8)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def parse(stream: bytes) -> list:
    """Inverse of `event`/`DONE` for tests and clients: the JSON objects, then the string "[DONE]"."""
    out: list = []
    for block in stream.decode().split("\n\n"):
        if not block.strip():
            continue
        if not block.startswith("data: "):
            raise ValueError(f"SSE event without a data field: {block[:80]!r}")
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def new_stream() -> web.StreamResponse:
    """An event stream's response, not yet sent (`open_stream` sends its status and headers)."""
    return web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # proxies must not buffer token streams
    })


async def open_stream(request: web.Request, resp: web.StreamResponse) -> None:
    await resp.prepare(request)
    request[STREAM_OPEN] = True
