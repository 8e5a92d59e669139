"""IndexBreaker: the gateway's prefix-index lookups, bounded in time and skipped while the index fails.

The index only steers routing, so a lookup that fails routes the request as a miss. Two things
would still hurt every request while Redis is unwell: a Redis that hangs (a partition, a stopped
process) holds each lookup until redis-py's socket timeout, seconds added to every time to first
token; and a Redis that refuses logs a line per request. So each lookup waits at most
--index-timeout, and after a failure the breaker opens: lookups are skipped (misses at once) for a
backoff that doubles from `FIRST_BACKOFF_S` to `MAX_BACKOFF_S`, then one lookup tries again. One
warning when it opens, one when a lookup answers again; `kvmesh:prefix_index_errors_total` counts
failed (reason error or timeout) and skipped lookups.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable, Optional

log = logging.getLogger("kvmesh.gateway")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 5.0


class IndexBreaker:
    def __init__(self, index: Any, timeout_s: float, on_error: Callable[[str], None] = lambda reason: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index  # kvmesh.index.PrefixIndex
        self.timeout_s = timeout_s
        self._on_error = on_error  # reason: error | timeout | skipped
        self._clock = clock
        self._failures = 0
        self._closed_at = -math.inf  # lookups are skipped until then
        self._down_since: Optional[float] = None

    @property
    def open(self) -> bool:
        return self._clock() < self._closed_at

    async def lookup(self, hashes: list[bytes]) -> list[frozenset[str]]:
        """Holders of each block; all empty (a miss) where the index fails, is slow or is skipped."""
        miss = [frozenset()] * len(hashes)
        now = self._clock()
        if now < self._closed_at:
            self._on_error("skipped")
            return miss
        try:
            holders = await asyncio.wait_for(self.index.lookup(hashes), self.timeout_s)
        except Exception as e:  # TimeoutError included
            self._trip(now, "timeout" if isinstance(e, TimeoutError) else "error", e)
            return miss
        if self._down_since is not None:
            log.warning("the prefix index answers again after %.1f s; routing by it", self._clock() - self._down_since)
            self._down_since = None
        self._failures = 0
        return holders

    def _trip(self, now: float, reason: str, e: Exception) -> None:
        self._on_error(reason)
        self._failures += 1
        backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self._failures - 1))
        self._closed_at = max(self._closed_at, now + backoff)
        if self._down_since is None:
            self._down_since = now
            what = f"no answer within {self.timeout_s:g} s (--index-timeout)" if reason == "timeout" else \
                f"{type(e).__name__}: {e}"
            log.warning("prefix index lookup failed (%s); routing every request as a miss, trying again "
                        "with backoff", what)
