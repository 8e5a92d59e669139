"""One in-memory prefix index shared by several processes: a `MemoryIndex` served over HTTP.

`kvmesh up` without --redis-url runs `kvmesh index` as its own process (the single owner of the
index) and gives every service `--redis-url http://127.0.0.1:PORT`; `kvmesh.index.make_index` turns
an http:// URL into a `RemoteIndex`, which has the same `PrefixIndex` interface as `MemoryIndex` and
`RedisIndex`. Every call is one HTTP request (so a lookup of N hashes is one round trip).

Wire: POST with a msgpack body, msgpack reply. No torch.
    POST /publish      {"holder": str, "stored": [bytes], "removed": [bytes]}  -> {}
    POST /lookup       {"hashes": [bytes]}                                    -> {"holders": [[str]]}
    POST /drop_holder  {"holder": str}                                        -> {}
    GET  /health       -> "ok"
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

import msgpack
from aiohttp import ClientSession, ClientTimeout, web

from kvmesh.index import MemoryIndex

log = logging.getLogger(__name__)
INDEX_KEY = web.AppKey("index", MemoryIndex)


def _pack(obj: Any) -> web.Response:
    return web.Response(body=msgpack.packb(obj, use_bin_type=True), content_type="application/msgpack")


async def _body(request: web.Request, *fields: str) -> dict:
    try:
        body = msgpack.unpackb(await request.read(), raw=False)
    except Exception as e:  # malformed msgpack of any kind
        raise web.HTTPBadRequest(text=f"body is not msgpack: {e}") from None
    missing = [f for f in fields if not isinstance(body, dict) or f not in body]
    if missing:
        raise web.HTTPBadRequest(text=f"missing field(s): {', '.join(missing)}")
    return body


async def _publish(request: web.Request) -> web.Response:
    b = await _body(request, "holder", "stored", "removed")
    await request.app[INDEX_KEY].publish(b["holder"], list(b["stored"]), list(b["removed"]))
    return _pack({})


async def _lookup(request: web.Request) -> web.Response:
    b = await _body(request, "hashes")
    holders = await request.app[INDEX_KEY].lookup(list(b["hashes"]))
    return _pack({"holders": [sorted(h) for h in holders]})


async def _drop_holder(request: web.Request) -> web.Response:
    b = await _body(request, "holder")
    await request.app[INDEX_KEY].drop_holder(b["holder"])
    return _pack({})


async def _health(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_index_app(index: Optional[MemoryIndex] = None) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[INDEX_KEY] = index if index is not None else MemoryIndex()
    app.router.add_post("/publish", _publish)
    app.router.add_post("/lookup", _lookup)
    app.router.add_post("/drop_holder", _drop_holder)
    app.router.add_get("/health", _health)
    return app


async def serve_index(host: str, port: int, on_ready: Callable[[], None] = lambda: None) -> None:
    """Serve one MemoryIndex at http://host:port until cancelled; `on_ready()` once it serves."""
    runner = web.AppRunner(make_index_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("prefix index (in memory) serving on http://%s:%d", host, port)
    on_ready()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class RemoteIndex:
    """`PrefixIndex` client of a `kvmesh index` server (url like http://127.0.0.1:50050)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--redis-url: a remote index URL must start with http://, got {url!r}")
        self.url = url.rstrip("/")
        self._timeout = ClientTimeout(total=timeout_s)
        self._session: Optional[ClientSession] = None  # made on first use, inside the running loop
        self._closed = False

    async def _call(self, path: str, body: dict) -> dict:
        if self._closed:  # a new session now would never be closed
            raise RuntimeError(f"index {self.url} used after close()")
        if self._session is None:
            self._session = ClientSession(timeout=self._timeout)
        data = msgpack.packb(body, use_bin_type=True)
        async with self._session.post(self.url + path, data=data,
                                      headers={"Content-Type": "application/msgpack"}) as r:
            payload = await r.read()
            if r.status != 200:
                raise RuntimeError(f"index {self.url}{path} answered {r.status}: {payload[:200]!r}")
        return msgpack.unpackb(payload, raw=False)

    async def publish(self, holder: str, stored: list[bytes], removed: list[bytes]) -> None:
        if stored or removed:
            await self._call("/publish", {"holder": holder, "stored": list(stored), "removed": list(removed)})

    async def lookup(self, hashes: list[bytes]) -> list[frozenset[str]]:
        if not hashes:
            return []
        reply = await self._call("/lookup", {"hashes": list(hashes)})
        return [frozenset(h) for h in reply["holders"]]

    async def drop_holder(self, holder: str) -> None:
        await self._call("/drop_holder", {"holder": holder})

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None
