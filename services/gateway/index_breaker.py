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
import time
from typing import Any, Callable

from kvmesh.outage import Outage

log = logging.getLogger("kvmesh.gateway")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 5.0


class IndexBreaker:
    def __init__(self, index: Any, timeout_s: float, on_error: Callable[[str], None] = lambda reason: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index  # kvmesh.index.PrefixIndex
        self.timeout_s = timeout_s
        self._on_error = on_error  # reason: error | timeout | skipped
        self._outage = Outage(FIRST_BACKOFF_S, MAX_BACKOFF_S, clock)  # lookups are skipped while it waits

    @property
    def open(self) -> bool:
        return self._outage.waiting()

    async def lookup(self, hashes: list[bytes]) -> list[frozenset[str]]:
        """Holders of each block; all empty (a miss) where the index fails, is slow or is skipped."""
        miss = [frozenset()] * len(hashes)
        if self._outage.waiting():
            self._on_error("skipped")
            return miss
        try:
            holders = await asyncio.wait_for(self.index.lookup(hashes), self.timeout_s)
        except Exception as e:  # TimeoutError included
            self._trip("timeout" if isinstance(e, TimeoutError) else "error", e)
            return miss
        lasted = self._outage.answered()
        if lasted is not None:
            log.warning("the prefix index answers again after %.1f s; routing by it", lasted)
        return holders

    def _trip(self, reason: str, e: Exception) -> None:
        self._on_error(reason)
        if self._outage.failed():
            what = f"no answer within {self.timeout_s:g} s (--index-timeout)" if reason == "timeout" else \
                f"{type(e).__name__}: {e}"
            log.warning("prefix index lookup failed (%s); routing every request as a miss, trying again "
                        "with backoff", what)
