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

import msgpack


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


# Every call is one Lua script: one round trip and one command whatever the number of hashes. Hashes
# go in as ONE argument of concatenated hex and holders come back as ONE msgpack string, because
# redis-py packs arguments and parses replies in Python per element: a pipeline of 256 SMEMBERS ran
# 35 lookups/s, this runs thousands. Block keys are built inside the script (not passed as KEYS), so
# this targets a standalone Redis (or one shard), not Redis Cluster.
_LOOKUP_LUA = """
local prefix, hexes, w = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
for i = 1, #hexes / w do
  out[i] = redis.call('SMEMBERS', prefix .. string.sub(hexes, (i - 1) * w + 1, i * w))
end
return cmsgpack.pack(out)
"""
# KEYS = [holder key]; ARGV = [holder, ttl, block key prefix, stored hexes, removed hexes, hex width]
_PUBLISH_LUA = """
local holder, ttl, prefix, w = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[6])
local stored, removed = ARGV[4], ARGV[5]
for i = 1, #stored / w do
  local hex = string.sub(stored, (i - 1) * w + 1, i * w)
  redis.call('SADD', prefix .. hex, holder)
  redis.call('EXPIRE', prefix .. hex, ttl)
  redis.call('SADD', KEYS[1], hex)
end
for i = 1, #removed / w do
  local hex = string.sub(removed, (i - 1) * w + 1, i * w)
  redis.call('SREM', prefix .. hex, holder)
  redis.call('SREM', KEYS[1], hex)
end
if #stored > 0 then redis.call('EXPIRE', KEYS[1], ttl) end
return 0
"""
# KEYS = [holder key]; ARGV = [holder, block key prefix]
_DROP_LUA = """
local members = redis.call('SMEMBERS', KEYS[1])
for _, hex in ipairs(members) do redis.call('SREM', ARGV[2] .. hex, ARGV[1]) end
redis.call('DEL', KEYS[1])
return #members
"""


def _hex_width(*groups: list[bytes]) -> int:
    """Hex digits per hash; every hash of a call must have the same length (32-byte SHA-256)."""
    sizes = {len(h) for g in groups for h in g}
    if len(sizes) > 1 or 0 in sizes:
        raise ValueError(f"block hashes must all have one non-zero length, got lengths {sorted(sizes)}")
    return 2 * sizes.pop() if sizes else 64


class RedisIndex:
    """Index in Redis (redis.asyncio). Every call is one Lua script: one round trip, atomic."""

    def __init__(self, url: str, *, namespace: str = "kvmesh", ttl_seconds: int = 3600) -> None:
        import redis.asyncio as aioredis  # lazy: only deployments with --redis-url need it

        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive, got {ttl_seconds}")
        self.url = url
        self.namespace = namespace
        self.ttl_seconds = int(ttl_seconds)
        self._redis = aioredis.Redis.from_url(url, decode_responses=False)
        self._lookup = self._redis.register_script(_LOOKUP_LUA)
        self._publish = self._redis.register_script(_PUBLISH_LUA)
        self._drop = self._redis.register_script(_DROP_LUA)

    def block_key(self, block_hash: bytes) -> str:
        return f"{self.namespace}:blk:{block_hash.hex()}"

    def holder_key(self, holder: str) -> str:
        return f"{self.namespace}:holder:{holder}"

    async def publish(self, holder: str, stored: list[bytes], removed: list[bytes]) -> None:
        if not stored and not removed:
            return
        width = _hex_width(stored, removed)
        await self._publish(keys=[self.holder_key(holder)],
                            args=[holder, self.ttl_seconds, f"{self.namespace}:blk:", b"".join(stored).hex(),
                                  b"".join(removed).hex(), width])

    async def lookup(self, hashes: list[bytes]) -> list[frozenset[str]]:
        if not hashes:
            return []
        width = _hex_width(hashes)
        raw = await self._lookup(keys=[], args=[f"{self.namespace}:blk:", b"".join(hashes).hex(), width])
        replies = msgpack.unpackb(raw, raw=False)
        if isinstance(replies, dict):  # cmsgpack packs an empty table as a map
            replies = [replies.get(i + 1, ()) for i in range(len(hashes))]
        empty: frozenset[str] = frozenset()
        return [frozenset(members) if members else empty for members in replies]

    async def drop_holder(self, holder: str) -> None:
        await self._drop(keys=[self.holder_key(holder)], args=[holder, f"{self.namespace}:blk:"])

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
