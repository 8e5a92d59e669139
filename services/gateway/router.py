"""Cache- and load-aware routing of one request to a decode worker (and maybe a prefill worker).

For a worker w the prompt's blocks split into three runs, in order (hashes are chained, so only a
prefix can be cached):  blocks w holds itself (free), blocks only a kvstore holds (cheap: pulled over
the network), the rest (computed). Then

    cost(w) = alpha * (uncached_tokens + store_weight * store_tokens + queued_prefill_tokens(w))
              + beta * load(w)

where the load terms are what this gateway has sent to w and not yet seen finish: requests in
flight, and prompt tokens w still has to prefill for them (a worker busy prefilling a long prompt
is as slow to start ours as if ours were longer). load(w) = max(in flight from this gateway, what w
last reported of its own: running + waiting sequences, or calls in flight): other gateways' requests
count too, so gateways sharing workers do not all herd onto the one each of them thinks is idle.

Workers within `tolerance` of the cheapest are near-equal: among them the least loaded wins and a
random one breaks what is still tied, so several gateways reading the same index do not all pick
the same worker (herding). If the chosen decode worker's uncached tail is short (or no prefill worker
is up), it prefills itself (GenerateRequest.do_prefill); otherwise a prefill worker does, chosen the
same way, and the decode worker is then chosen by load and by how much it can skip pulling.

Holders that are not a known worker are taken to be kvstore nodes (the index holds only both kinds).
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

REASONS = ("hit", "miss_short_prefix", "miss_evicted", "miss_cold", "routed_away_for_load")
LATE_CHECKS_DOWN = 3  # health checks in a row without an answer in time before a worker counts as down


class NoWorkerError(RuntimeError):
    """No healthy decode worker: the caller answers 503."""


@dataclass
class WorkerState:
    address: str
    role: str  # "prefill" | "decode"
    in_flight: int = 0
    queued_tokens: int = 0
    """Prompt tokens sent to this worker for prefill whose first token has not come back yet."""
    healthy: bool = True
    reported_load: int = 0
    """What the worker last said it carries (Load RPC, polled with health): every gateway's requests."""
    late_checks: int = 0
    """Health checks in a row that got no answer in time (`Router.observe`)."""

    @property
    def load(self) -> int:
        """Requests this worker is busy with: ours in flight are counted at once, others' as reported."""
        return max(self.in_flight, self.reported_load)


@dataclass(frozen=True)
class Prefix:
    """What one worker finds cached of the prompt: `local` blocks it holds, then `store` blocks in kvstore."""

    local: int
    store: int

    @property
    def blocks(self) -> int:
        return self.local + self.store


@dataclass(frozen=True)
class RouteDecision:
    decode: str
    prefill: Optional[str]
    """None: the decode worker prefills itself (do_prefill)."""
    reason: str
    hit_blocks: int
    """Prompt blocks the prefilling worker should find cached (local or in kvstore)."""
    predicted_hit_tokens: int
    cached_blocks: tuple[tuple[bytes, str], ...]
    """(hash, node) for each of the first `hit_blocks` blocks: the node to pull it from."""
    costs: dict = field(default_factory=dict, compare=False)


class Router:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *, block_size: int,
                 alpha: float = 1.0, beta: float = 512.0, store_weight: float = 0.1,
                 tolerance: float = 64.0, prefill_threshold_tokens: int = 256,
                 rng: Optional[random.Random] = None, seen_capacity: int = 65536) -> None:
        if not decode:
            raise ValueError("--decode: the router needs at least one decode worker")
        self.workers: dict[str, WorkerState] = {}
        for a in prefill:
            self.workers[a] = WorkerState(a, "prefill")
        for a in decode:
            if a in self.workers:
                raise ValueError(f"--decode {a} is also given as --prefill; a worker has one role")
            self.workers[a] = WorkerState(a, "decode")
        self._worker_set = frozenset(self.workers)
        self.block_size = block_size
        self.alpha, self.beta, self.store_weight = alpha, beta, store_weight
        self.tolerance = tolerance
        self.prefill_threshold_tokens = prefill_threshold_tokens
        self.rng = rng or random.Random()
        # First-block hashes this gateway has routed: a later miss on one means it was evicted.
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._seen_capacity = seen_capacity

    # -- worker state ---------------------------------------------------------------------------
    def healthy(self, role: str) -> list[str]:
        return [w.address for w in self.workers.values() if w.role == role and w.healthy]

    def mark(self, address: str, healthy: bool) -> None:
        self.workers[address].healthy = healthy

    def report_load(self, address: str, load: int) -> None:
        self.workers[address].reported_load = max(0, load)

    def observe(self, address: str, healthy: Optional[bool], load: Optional[int]) -> bool:
        """One health poll of a worker: `healthy` True or False (it serves or not, or is unreachable),
        None (no answer in time); `load` as it reported it, None without an answer. A late answer is not
        a death: a worker busy with a long step answers late, and marking it down would turn away
        requests it can take; LATE_CHECKS_DOWN late answers in a row do. Without a load report the last
        one stands (busy is not idle) unless the worker is down. Returns whether it went up or down."""
        w = self.workers[address]
        w.late_checks = 0 if healthy is not None else w.late_checks + 1
        up = healthy if healthy is not None else w.healthy and w.late_checks < LATE_CHECKS_DOWN
        changed = up != w.healthy
        self.mark(address, up)
        if load is not None or not up:
            self.report_load(address, 0 if load is None else load)
        return changed

    def begin(self, address: str, prefill_tokens: int = 0) -> None:
        w = self.workers[address]
        w.in_flight += 1
        w.queued_tokens += prefill_tokens

    def prefilled(self, address: str, prefill_tokens: int) -> None:
        """The worker produced the first token: its prefill work for this request is done."""
        w = self.workers[address]
        w.queued_tokens = max(0, w.queued_tokens - prefill_tokens)

    def end(self, address: str, prefill_tokens: int = 0) -> None:
        """Request done; `prefill_tokens` still queued if `prefilled` was never called."""
        w = self.workers[address]
        w.in_flight = max(0, w.in_flight - 1)
        w.queued_tokens = max(0, w.queued_tokens - prefill_tokens)

    # -- math -----------------------------------------------------------------------------------
    def prefix_for(self, address: str, holders: Sequence[frozenset[str]]) -> Prefix:
        return self.prefixes(holders, [address])[address]

    def prefixes(self, holders: Sequence[frozenset[str]], addresses: Sequence[str]) -> dict[str, Prefix]:
        """Prefix of each worker; one pass over the blocks for all workers that hold none locally."""
        workers = self._worker_set
        in_store = [not hs <= workers for hs in holders]  # some non-worker (a kvstore node) holds it
        base = 0
        while base < len(in_store) and in_store[base]:
            base += 1
        holding = set().union(*holders) & workers if holders else set()
        out = {}
        for a in addresses:
            if a not in holding:
                out[a] = Prefix(0, base)
                continue
            local = store = 0
            for hs, s in zip(holders, in_store):
                if a in hs:
                    local += 1
                elif s:
                    store += 1
                else:
                    break
            out[a] = Prefix(local, store)
        return out

    def cost(self, address: str, num_tokens: int, prefix: Prefix) -> float:
        bs = self.block_size
        cached = min(prefix.blocks * bs, num_tokens)
        store_tokens = min(prefix.store * bs, cached)
        uncached = num_tokens - cached
        w = self.workers[address]
        return (self.alpha * (uncached + self.store_weight * store_tokens + w.queued_tokens)
                + self.beta * w.load)

    def choose(self, costs: dict[str, float]) -> str:
        """Cheapest within tolerance, then least loaded, then random (anti-herding)."""
        best = min(costs.values())
        near = [a for a, c in costs.items() if c <= best + self.tolerance]
        load = {a: (self.workers[a].load, self.workers[a].queued_tokens) for a in near}
        least = min(load.values())
        finalists = sorted(a for a in near if load[a] == least)
        return finalists[0] if len(finalists) == 1 else self.rng.choice(finalists)

    def _refs(self, address: str, hashes: Sequence[bytes], holders: Sequence[frozenset[str]],
              n: int) -> tuple[tuple[bytes, str], ...]:
        refs = []
        for h, hs in zip(hashes[:n], holders[:n]):
            if address in hs:
                refs.append((h, address))
            else:
                stores = sorted(x for x in hs if x not in self.workers)
                refs.append((h, stores[0]))
        return tuple(refs)

    # -- the decision ---------------------------------------------------------------------------
    def route(self, num_tokens: int, hashes: Sequence[bytes],
              holders: Sequence[frozenset[str]]) -> RouteDecision:
        if len(holders) != len(hashes):
            raise ValueError(f"holders ({len(holders)}) must match hashes ({len(hashes)})")
        decoders = self.healthy("decode")
        if not decoders:
            raise NoWorkerError("no healthy decode worker; check the --decode workers")
        prefixes = self.prefixes(holders, list(self.workers))
        self_costs = {a: self.cost(a, num_tokens, prefixes[a]) for a in decoders}
        decode = self.choose(self_costs)
        tail = num_tokens - min(prefixes[decode].blocks * self.block_size, num_tokens)
        prefillers = self.healthy("prefill")
        if not prefillers or tail <= self.prefill_threshold_tokens:
            doer, pool, costs = decode, decoders, self_costs
            prefill = None
        else:
            costs = {a: self.cost(a, num_tokens, prefixes[a]) for a in prefillers}
            prefill = doer = self.choose(costs)
            pool = prefillers
            # After the prefill every full block is in kvstore; a decode worker that holds some of
            # them locally pulls less. Store weight per block not held, plus load.
            n = len(hashes)
            pull = {a: self.alpha * self.store_weight * (n - prefixes[a].local) * self.block_size
                    + self.beta * self.workers[a].load for a in decoders}
            decode = self.choose(pull)
        hit = prefixes[doer].blocks
        best_hit = max(prefixes[a].blocks for a in pool)
        reason = self._reason(num_tokens, hashes, hit, best_hit)
        if hashes:
            self._remember(hashes[0])
        return RouteDecision(decode=decode, prefill=prefill, reason=reason, hit_blocks=hit,
                             predicted_hit_tokens=min(hit * self.block_size, num_tokens),
                             cached_blocks=self._refs(doer, hashes, holders, hit), costs=costs)

    def _reason(self, num_tokens: int, hashes: Sequence[bytes], hit: int, best_hit: int) -> str:
        if num_tokens < self.block_size:
            return "miss_short_prefix"
        if hit < best_hit:
            return "routed_away_for_load"
        if hit > 0:
            return "hit"
        # A cache_salt mismatch is indistinguishable from a first sight: both count as cold.
        return "miss_evicted" if hashes and hashes[0] in self._seen else "miss_cold"

    def _remember(self, h: bytes) -> None:
        self._seen[h] = None
        self._seen.move_to_end(h)
        while len(self._seen) > self._seen_capacity:
            self._seen.popitem(last=False)
