"""The prefix index: which holders (kvstore nodes, workers) hold which KV blocks. No torch.

The index is advisory. The stores are the source of truth; an index entry that went stale (its holder
evicted the block or died) only costs the reader a miss and a recompute. So publishing is batched and
best effort, and entries in Redis carry a TTL that every re-publish renews.

Redis keys (namespace `kvmesh` by default; see docs/kvstore.md):
    <ns>:blk:<hex hash>   SET of holder addresses ("host:port") that hold the block; TTL `ttl_seconds`
    <ns>:holder:<holder>  SET of hex hashes the holder published, so `drop_holder` can clean up after a
                          holder that leaves; TTL `ttl_seconds`
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class PrefixIndex(Protocol):
    async def publish(self, holder: str, stored: list[bytes], removed: list[bytes]) -> None:
        """Record that `holder` now holds `stored` and no longer holds `removed`."""
        ...

    async def lookup(self, hashes: list[bytes]) -> list[frozenset[str]]:
        """Holders of each block, in order (empty set: nobody), in ONE round trip."""
        ...

    async def drop_holder(self, holder: str) -> None:
        """Forget every entry of `holder` (it shut down or died)."""
        ...

    async def close(self) -> None:
        ...


class MemoryIndex:
    """In-process index: a dict of hash -> holders. Shared only by the coroutines of one process."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._by_holder: dict[str, set[bytes]] = {}

    async def publish(self, holder: str, stored: list[bytes], removed: list[bytes]) -> None:
        mine = self._by_holder.setdefault(holder, set())
        for h in stored:
            self._holders.setdefault(h, set()).add(holder)
            mine.add(h)
        for h in removed:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(holder)
                if not holders:
                    del self._holders[h]
            mine.discard(h)

    async def lookup(self, hashes: list[bytes]) -> list[frozenset[str]]:
        empty: frozenset[str] = frozenset()
        return [frozenset(self._holders[h]) if h in self._holders else empty for h in hashes]

    async def drop_holder(self, holder: str) -> None:
        await self.publish(holder, [], list(self._by_holder.pop(holder, ())))

    async def close(self) -> None:
        self._holders.clear()
        self._by_holder.clear()


class RedisIndex:
    """Index in Redis (redis.asyncio). Lookups of N hashes are one pipelined round trip."""

    def __init__(self, url: str, *, namespace: str = "kvmesh", ttl_seconds: int = 3600) -> None:
        import redis.asyncio as aioredis  # lazy: only deployments with --redis-url need it

        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive, got {ttl_seconds}")
        self.url = url
        self.namespace = namespace
        self.ttl_seconds = int(ttl_seconds)
        self._redis = aioredis.Redis.from_url(url, decode_responses=False)

    def block_key(self, block_hash: bytes) -> str:
        return f"{self.namespace}:blk:{block_hash.hex()}"

    def holder_key(self, holder: str) -> str:
        return f"{self.namespace}:holder:{holder}"

    async def publish(self, holder: str, stored: list[bytes], removed: list[bytes]) -> None:
        if not stored and not removed:
            return
        hkey = self.holder_key(holder)
        pipe = self._redis.pipeline(transaction=False)
        for h in stored:
            key = self.block_key(h)
            pipe.sadd(key, holder)
            pipe.expire(key, self.ttl_seconds)
        if stored:
            pipe.sadd(hkey, *[h.hex() for h in stored])
            pipe.expire(hkey, self.ttl_seconds)
        for h in removed:
            pipe.srem(self.block_key(h), holder)  # redis deletes a set when its last member goes
        if removed:
            pipe.srem(hkey, *[h.hex() for h in removed])
        await pipe.execute()

    async def lookup(self, hashes: list[bytes]) -> list[frozenset[str]]:
        if not hashes:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for h in hashes:
            pipe.smembers(self.block_key(h))
        replies = await pipe.execute()
        return [frozenset(m.decode() for m in members) for members in replies]

    async def drop_holder(self, holder: str) -> None:
        hkey = self.holder_key(holder)
        members = await self._redis.smembers(hkey)
        pipe = self._redis.pipeline(transaction=False)
        for hex_hash in members:
            pipe.srem(f"{self.namespace}:blk:{hex_hash.decode()}", holder)
        pipe.delete(hkey)
        await pipe.execute()

    async def close(self) -> None:
        await self._redis.aclose()


def make_index(redis_url: str | None) -> PrefixIndex:
    """RedisIndex for a redis:// (or rediss://, unix://) URL; MemoryIndex for None or ""."""
    if not redis_url:
        return MemoryIndex()
    if redis_url.startswith(("http://", "https://")):  # one shared MemoryIndex served by `kvmesh index`
        from kvmesh.remote_index import RemoteIndex
        return RemoteIndex(redis_url)
    if not redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--redis-url must start with redis://, rediss:// or unix://, got {redis_url!r}")
    return RedisIndex(redis_url)
