"""Leases: a block being read, or about to be read, must not be evicted.

A lease is (block, holder) -> expiry. Leases expire on their own so that a holder that dies never pins
memory for longer than its lease. Only Get grants or renews leases; Contains never does.
"""
from __future__ import annotations

import time
from typing import Callable


class LeaseTable:
    def __init__(self, max_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_seconds = max_seconds
        self._clock = clock
        self._leases: dict[bytes, dict[str, float]] = {}  # hash -> holder -> expiry (clock seconds)

    def grant(self, block_hash: bytes, holder: str, seconds: float) -> None:
        """Lease (or re-lease) a block to `holder` for `seconds`, clipped to --lease-seconds."""
        if seconds <= 0:
            return
        expiry = self._clock() + min(seconds, self.max_seconds)
        holders = self._leases.setdefault(block_hash, {})
        holders[holder] = max(expiry, holders.get(holder, 0.0))

    def release(self, block_hash: bytes, holder: str) -> bool:
        holders = self._leases.get(block_hash)
        if holders is None or holder not in holders:
            return False
        del holders[holder]
        if not holders:
            del self._leases[block_hash]
        return True

    def is_leased(self, block_hash: bytes) -> bool:
        """True while any unexpired lease remains; expired ones are dropped here."""
        holders = self._leases.get(block_hash)
        if not holders:
            return False
        now = self._clock()
        live = {h: t for h, t in holders.items() if t > now}
        if live:
            if len(live) != len(holders):
                self._leases[block_hash] = live
            return True
        del self._leases[block_hash]
        return False

    def forget(self, block_hash: bytes) -> None:
        """Drop every lease on a block that left the store."""
        self._leases.pop(block_hash, None)

    def count(self) -> int:
        """Blocks with an unexpired lease."""
        return sum(1 for h in list(self._leases) if self.is_leased(h))
