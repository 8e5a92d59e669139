"""Outage: the failures in a row of one dependency (the prefix index, the kvstore), as its caller sees them.

It says when to try again (a backoff that doubles from `first_backoff_s` up to `max_backoff_s`) and
when an outage starts and ends, so that the caller logs one line for each instead of one a call.
Callers: `IndexFeed` (a holder's publishes), the gateway's `IndexBreaker` (lookups) and
`BlockTransfer` (a worker's kvstore calls, which only log).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional


class Outage:
    def __init__(self, first_backoff_s: float = 0.0, max_backoff_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._failures = 0
        self._retry_at = -math.inf
        self._since: Optional[float] = None  # the first failure of the current outage

    @property
    def down(self) -> bool:
        return self._since is not None

    def waiting(self) -> bool:
        """Whether the backoff after the last failure still runs (do not try yet)."""
        return self._clock() < self._retry_at

    def failed(self) -> bool:
        """Counts a failure and starts the next backoff; True where it starts an outage (log it)."""
        now = self._clock()
        self._failures += 1
        backoff = min(self.max_backoff_s, self.first_backoff_s * 2 ** (self._failures - 1))
        self._retry_at = max(self._retry_at, now + backoff)
        started = self._since is None
        if started:
            self._since = now
        return started

    def answered(self) -> Optional[float]:
        """A call went through: the outage it ends, in seconds (log it), or None where there was none."""
        self._failures, self._retry_at = 0, -math.inf
        if self._since is None:
            return None
        lasted, self._since = self._clock() - self._since, None
        return lasted
