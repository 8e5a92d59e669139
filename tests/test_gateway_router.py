"""Routing math of the gateway: prefixes per worker, costs, reasons, prefill hop, herding, dead workers."""
from __future__ import annotations

import random

import pytest

from kvmesh.gateway.router import LATE_CHECKS_DOWN, NoWorkerError, Prefix, Router
from kvmesh.hashing import HashContext, block_hashes

BS = 16
P1, P2 = "10.0.0.1:1", "10.0.0.2:1"
D1, D2, D3 = "10.0.1.1:1", "10.0.1.2:1", "10.0.1.3:1"
S1, S2 = "10.0.2.1:1", "10.0.2.2:1"  # kvstore nodes: holders that are no worker


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def router(prefill=(P1, P2), decode=(D1, D2), seed=0, **kw) -> Router:
    kw.setdefault("prefill_threshold_tokens", 64)
    return Router(prefill, decode, block_size=BS, alpha=1.0, beta=512.0, store_weight=0.1,
                  tolerance=8.0, rng=random.Random(seed), **kw)


def holders_of(n_blocks: int, spec: dict[int, set[str]]) -> list[frozenset[str]]:
    """spec: block index -> holders (others hold nothing)."""
    return [frozenset(spec.get(i, ())) for i in range(n_blocks)]


def test_prefix_splits_local_store_and_stops_at_first_gap():
    r = router()
    hs = holders_of(6, {0: {D1, S1}, 1: {D1}, 2: {S2}, 3: {D2}, 4: {S1}})
    assert r.prefix_for(D1, hs) == Prefix(local=2, store=1)  # block 3 only on D2: unreachable for D1
    assert r.prefix_for(D2, hs) == Prefix(local=0, store=1)  # block 1 only on D1: unreachable for D2
    assert r.prefix_for(D2, holders_of(4, {0: {S1}, 1: {D2}, 2: {S1, D2}})) == Prefix(local=2, store=1)
    assert r.prefix_for(P1, holders_of(3, {})) == Prefix(0, 0)


def test_cost_is_alpha_uncached_plus_store_weight_plus_beta_load():
    r = router()
    r.begin(D2)
    r.begin(D2)
    # 100 tokens, 2 local + 3 store blocks = 80 cached, 48 of them from the store
    assert r.cost(D2, 100, Prefix(2, 3)) == pytest.approx(1.0 * (20 + 0.1 * 48) + 512.0 * 2)
    # a fully cached prompt costs no compute
    assert r.cost(D1, 32, Prefix(2, 0)) == 0.0


def test_hit_routes_to_holder_and_records_block_refs():
    r = router(prefill=())
    ids = prompt(5 * BS + 3, 1)
    hashes = block_hashes(ids, HashContext("m", "fp32", BS))
    hs = holders_of(5, {i: {D2} for i in range(3)} | {3: {S1, S2}})
    d = r.route(len(ids), hashes, hs)
    assert (d.decode, d.prefill, d.reason, d.hit_blocks) == (D2, None, "hit", 4)
    assert d.predicted_hit_tokens == 4 * BS
    assert d.cached_blocks == tuple((hashes[i], D2) for i in range(3)) + ((hashes[3], S1),)


def test_cold_then_evicted_then_short():
    r = router(prefill=())
    ids = prompt(3 * BS, 2)
    hashes = block_hashes(ids, HashContext("m", "fp32", BS))
    assert r.route(len(ids), hashes, holders_of(3, {})).reason == "miss_cold"
    # same prompt again, the index lost it: this gateway saw it before
    assert r.route(len(ids), hashes, holders_of(3, {})).reason == "miss_evicted"
    short = ids[:BS - 1]
    d = r.route(len(short), [], [])
    assert d.reason == "miss_short_prefix" and d.hit_blocks == 0 and d.cached_blocks == ()
    # another salt hashes differently: indistinguishable from a first sight
    other = block_hashes(ids, HashContext("m", "fp32", BS, cache_salt="tenant-b"))
    assert r.route(len(ids), other, holders_of(3, {})).reason == "miss_cold"


def test_routed_away_for_load():
    r = router(prefill=())
    ids = prompt(8 * BS, 3)
    hashes = block_hashes(ids, HashContext("m", "fp32", BS))
    hs = holders_of(8, {i: {D1} for i in range(8)})
    assert r.route(len(ids), hashes, hs).decode == D1
    for _ in range(3):  # 3 * 512 > 128 uncached tokens on D2
        r.begin(D1)
    d = r.route(len(ids), hashes, hs)
    assert (d.decode, d.reason, d.hit_blocks, d.cached_blocks) == (D2, "routed_away_for_load", 0, ())


def test_prefill_hop_only_for_long_uncached_tails():
    r = router()
    long_ids = prompt(10 * BS, 4)
    hashes = block_hashes(long_ids, HashContext("m", "fp32", BS))
    d = r.route(len(long_ids), hashes, holders_of(10, {}))
    assert d.prefill in (P1, P2) and d.decode in (D1, D2) and d.reason == "miss_cold"
    # 8 of 10 blocks cached in kvstore: a 32-token tail is under the 64-token threshold
    d = r.route(len(long_ids), hashes, holders_of(10, {i: {S1} for i in range(8)}))
    assert d.prefill is None and d.reason == "hit" and d.hit_blocks == 8
    # the prefill worker holding the prefix locally is preferred over the other
    d = r.route(len(long_ids), hashes, holders_of(10, {0: {P2}, 1: {P2}}))
    assert d.prefill == P2 and d.cached_blocks == ((hashes[0], P2), (hashes[1], P2))
    # no prefill worker up: the decode worker prefills itself
    r.mark(P1, False)
    r.mark(P2, False)
    assert r.route(len(long_ids), hashes, holders_of(10, {})).prefill is None


def test_queued_prefill_tokens_count_as_load():
    r = router()
    ids = prompt(20 * BS, 8)
    hashes = block_hashes(ids, HashContext("m", "fp32", BS))
    r.begin(P1, prefill_tokens=4096)  # P1 is busy prefilling a long prompt for someone else
    assert r.cost(P1, len(ids), Prefix(0, 0)) == pytest.approx(320 + 4096 + 512)
    d = r.route(len(ids), hashes, holders_of(20, {i: {P1} for i in range(10)}))
    assert d.prefill == P2 and d.reason == "routed_away_for_load"
    r.prefilled(P1, 4096)  # its first token came back: only the request remains
    assert r.workers[P1].queued_tokens == 0 and r.workers[P1].in_flight == 1
    r.end(P1)
    assert r.route(len(ids), hashes, holders_of(20, {i: {P1} for i in range(10)})).prefill == P1
    r.begin(D1, prefill_tokens=100)
    r.end(D1, prefill_tokens=100)  # ended before its first token: the queue drains too
    assert (r.workers[D1].in_flight, r.workers[D1].queued_tokens) == (0, 0)


def test_decode_after_prefill_prefers_local_blocks_then_load():
    r = router()
    ids = prompt(14 * BS, 5)
    hashes = block_hashes(ids, HashContext("m", "fp32", BS))
    hs = holders_of(14, {i: {D2, S1} for i in range(6)})
    d = r.route(len(ids), hashes, hs)  # D2 pulls 8 blocks after the prefill, D1 14
    assert d.prefill is not None and d.decode == D2 and d.hit_blocks == 6
    r.begin(D2)  # one request in flight outweighs 6 blocks of pulling
    assert r.route(len(ids), hashes, hs).decode == D1


def test_near_equal_costs_spread_across_workers_without_herding():
    """Many gateways (own rng, no shared load) seeing the same index must not all pick one worker."""
    ids = prompt(4 * BS, 6)
    hashes = block_hashes(ids, HashContext("m", "fp32", BS))
    hs = holders_of(4, {})
    picks = [router(prefill=(), decode=(D1, D2, D3), seed=s).route(len(ids), hashes, hs).decode
             for s in range(60)]
    counts = {d: picks.count(d) for d in (D1, D2, D3)}
    assert all(c >= 8 for c in counts.values()), counts
    # within one gateway, in-flight load breaks the tie deterministically
    r = router(prefill=(), decode=(D1, D2, D3))
    r.begin(D1)
    r.begin(D3)
    assert r.route(len(ids), hashes, hs).decode == D2


def test_dead_workers_are_routed_around():
    r = router(prefill=())
    ids = prompt(4 * BS, 7)
    hashes = block_hashes(ids, HashContext("m", "fp32", BS))
    hs = holders_of(4, {i: {D1} for i in range(4)})
    r.mark(D1, False)
    assert r.route(len(ids), hashes, hs).decode == D2
    r.mark(D2, False)
    with pytest.raises(NoWorkerError, match="--decode"):
        r.route(len(ids), hashes, hs)
    r.mark(D1, True)
    assert r.route(len(ids), hashes, hs).decode == D1


def test_bad_router_setup_names_the_flag():
    with pytest.raises(ValueError, match="--decode"):
        Router([P1], [], block_size=BS)
    with pytest.raises(ValueError, match="--decode 10.0.0.1:1 is also given as --prefill"):
        Router([P1], [P1], block_size=BS)
    with pytest.raises(ValueError, match="holders"):
        router().route(32, [b"x" * 32, b"y" * 32], [frozenset()])


def test_reported_load_of_other_gateways_steers_routing():
    """Two gateways share D1, D2; the other one keeps D1 busy. This gateway's own in-flight counts are
    zero for both, so only D1's reported load (Load RPC) sends ours to D2 — every time, not at random."""
    r = router(prefill=(), decode=(D1, D2), seed=3)
    p = prompt(40, seed=1)
    hs = block_hashes(p, HashContext("m", "fp32", BS, ""))
    none = holders_of(len(hs), {})
    picks_before = {r.route(len(p), hs, none).decode for _ in range(40)}
    assert picks_before == {D1, D2}  # equal costs: the random tie-break spreads them
    r.report_load(D1, 3)
    assert r.workers[D1].load == 3 and r.workers[D2].load == 0
    assert {r.route(len(p), hs, none).decode for _ in range(40)} == {D2}
    # our own in-flight requests count at once; a stale lower report does not hide them
    for _ in range(5):
        r.begin(D2)
    assert r.workers[D2].load == 5
    assert r.route(len(p), hs, none).decode == D1
    r.report_load(D1, -1)  # nonsense from a worker is clamped
    assert r.workers[D1].reported_load == 0


def test_late_health_answers_do_not_take_a_busy_worker_down():
    """A health check that gets no answer in time (a worker busy with a long step) keeps the worker up
    and its last reported load; LATE_CHECKS_DOWN late answers in a row take it down, a definite "not
    serving" or "unreachable" at once, and one answer brings it back."""
    r = router(prefill=(), decode=(D1, D2), seed=3)
    assert r.observe(D1, True, 3) is False and r.workers[D1].reported_load == 3
    for _ in range(LATE_CHECKS_DOWN - 1):
        assert r.observe(D1, None, None) is False
        assert r.workers[D1].healthy and r.workers[D1].reported_load == 3  # busy, not idle
    assert r.healthy("decode") == [D1, D2]
    assert r.observe(D1, None, None) is True  # the last late answer in a row
    assert not r.workers[D1].healthy and r.workers[D1].reported_load == 0
    assert r.healthy("decode") == [D2]
    assert r.observe(D1, True, 1) is True and r.workers[D1].healthy and r.workers[D1].reported_load == 1
    assert r.observe(D1, None, None) is False and r.workers[D1].late_checks == 1
    assert r.observe(D1, True, None) is False and r.workers[D1].late_checks == 0  # an answer resets the count
    assert r.observe(D2, False, None) is True and r.healthy("decode") == [D1]  # unreachable: down at once
