"""BlockPool and KVCacheManager invariants, asserted exactly (free-queue order, ref counts, events)."""
from __future__ import annotations

import random

import pytest

from kvmesh.hashing import HashContext, block_hashes
from kvmesh.kv.block_pool import BlockPool
from kvmesh.kv.kv_cache_manager import ComputedBlocks, KVCacheManager

BS = 4
CTX = HashContext("test-model", "int8", BS)


def order(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def prompt(n: int, seed: int) -> tuple[list[int], list[bytes]]:
    rng = random.Random(seed)
    toks = [rng.randrange(50000) for _ in range(n)]
    return toks, block_hashes(toks, CTX)


def test_allocation_pops_lru_head_and_free_appends_tail_first():
    m = KVCacheManager(8, block_size=BS)
    a = m.allocate(3)
    assert a == [0, 1, 2]
    b = m.allocate(2)
    assert b == [3, 4]
    m.free(a)
    assert order(m.pool) == [5, 6, 7, 2, 1, 0]  # a's tail block first
    m.free(b)
    assert order(m.pool) == [5, 6, 7, 2, 1, 0, 4, 3]
    assert m.allocate(4) == [5, 6, 7, 2]
    m.pool.check_integrity()


def test_eviction_order_drops_hashes_and_emits_events():
    m = KVCacheManager(4, block_size=BS)
    toks, hs = prompt(12, 1)
    ids = m.allocate(3)
    for i in range(3):
        assert m.cache_block(ids[i], hs[i], toks[i * BS:(i + 1) * BS])
    m.free(ids)
    assert order(m.pool) == [3, 2, 1, 0]
    assert m.drain_events() == [("stored", hs[0]), ("stored", hs[1]), ("stored", hs[2])]
    assert m.drain_events() == []
    got = m.allocate(2)  # the uncached block 3, then block 2 = the prompt's *last* block
    assert got == [3, 2]
    assert m.drain_events() == [("removed", hs[2])]
    assert not m.contains(hs[2]) and m.contains(hs[1]) and m.contains(hs[0])
    assert m.lookup(hs, toks) == [0, 1]  # still a prefix hit on what is left
    m.pool.check_integrity()


def test_prefix_hit_removes_free_block_from_middle_and_counts_refs():
    m = KVCacheManager(6, block_size=BS, num_residual_slots=4)
    toks, hs = prompt(9, 2)  # 2 full blocks + 1 token
    assert m.allocate_slots("a", 9, m.get_computed_blocks(toks, hs))
    ta = m.block_table("a")
    assert ta == [0, 1]
    assert m.cache_full_blocks("a", toks, hs, 9) == 2
    m.free_request("a")
    assert order(m.pool) == [2, 3, 4, 5, 1, 0]
    comp = m.get_computed_blocks(toks, hs)
    assert comp == ComputedBlocks([0, 1], 8)
    assert m.allocate_slots("b", 1, comp)
    assert m.block_table("b") == [0, 1]
    assert order(m.pool) == [2, 3, 4, 5]
    assert [m.pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]
    assert m.allocate_slots("c", 1, m.get_computed_blocks(toks, hs))
    assert [m.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    m.free_request("b")
    assert [m.pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1] and order(m.pool) == [2, 3, 4, 5]
    m.free_request("c")
    assert order(m.pool) == [2, 3, 4, 5, 1, 0]
    assert (m.queries, m.hits) == (27, 16)
    m.check_integrity()


def test_hit_with_token_mismatch_is_rejected():
    m = KVCacheManager(4, block_size=BS)
    toks, hs = prompt(8, 3)
    [bid] = m.allocate(1)
    wrong = [t + 1 for t in toks[:BS]]
    m.cache_block(bid, hs[0], wrong)  # as if two different blocks collided on one hash
    m.free([bid])
    assert m.lookup(hs, toks) == []
    assert m.lookup(hs, wrong + toks[BS:]) == [bid]
    assert m.get_computed_blocks(toks, hs).num_tokens == 0


def test_computed_blocks_always_leave_one_token():
    m = KVCacheManager(8, block_size=BS, num_residual_slots=2)
    toks, hs = prompt(8, 4)  # exactly two blocks
    assert m.allocate_slots("a", 8, m.get_computed_blocks(toks, hs))
    m.cache_full_blocks("a", toks, hs, 8)
    m.free_request("a")
    assert m.get_computed_blocks(toks, hs) == ComputedBlocks([m.lookup(hs)[0]], 4)
    assert m.get_computed_blocks(toks[:1], hs[:0]).num_tokens == 0


def test_allocate_slots_failure_changes_nothing():
    m = KVCacheManager(3, block_size=BS, num_residual_slots=2)
    assert m.allocate_slots("a", 8)  # 2 pages
    free, events = m.num_free_blocks, list(m.pool.events)
    assert not m.allocate_slots("b", 8)  # needs 2, 1 free
    assert not m.allocate_slots("a", 8)  # a would need 2 more
    assert m.num_free_blocks == free and m.pool.events == events
    with pytest.raises(KeyError, match="'b'"):
        m.block_table("b")
    assert m.block_table("a") == [0, 1]
    assert m.allocate_slots("a", 3)  # 11 tokens -> still 2 full blocks, tail in the residual slot
    assert m.allocate_slots("a", 1) and m.block_table("a") == [0, 1, 2]
    assert m.allocate_slots("b", 1)  # no page needed yet: only a residual slot
    assert m.residual_slot("b") != m.residual_slot("a") and m.block_table("b") == []
    assert not m.allocate_slots("b", 3)  # its first full block finds no page


def test_residual_slots_are_one_per_request_and_recycled():
    m = KVCacheManager(16, block_size=BS, num_residual_slots=2)
    assert m.allocate_slots("a", 2) and m.allocate_slots("b", 2)
    assert {m.residual_slot("a"), m.residual_slot("b")} == {0, 1}
    assert not m.allocate_slots("c", 2)
    m.free_request("a")
    assert m.allocate_slots("c", 2) and m.residual_slot("c") == 0


def test_cache_full_blocks_covers_generated_tokens_and_fork_shares():
    m = KVCacheManager(16, block_size=BS, num_residual_slots=3)
    toks, hs = prompt(6, 5)
    assert m.allocate_slots("a", 6)
    assert m.cache_full_blocks("a", toks, hs, 6) == 1
    assert m.fork_request("a", "a#1")
    assert m.block_table("a#1") == m.block_table("a") and m.residual_slot("a#1") != m.residual_slot("a")
    assert m.pool.blocks[m.block_table("a")[0]].ref_cnt == 2
    toks += [7, 8]  # two generated tokens complete block 1
    hs = block_hashes(toks, CTX)
    assert m.allocate_slots("a", 2)
    assert m.cache_full_blocks("a", toks, hs, 8) == 1
    assert m.drain_events() == [("stored", hs[0]), ("stored", hs[1])]
    assert m.lookup(hs, toks) == m.block_table("a")[:2]
    m.free_request("a")
    m.free_request("a#1")
    assert m.num_free_blocks == 16 and m.usage == 0.0
    m.check_integrity()


def test_duplicate_hash_and_caching_off():
    m = KVCacheManager(4, block_size=BS)
    toks, hs = prompt(4, 6)
    a, b = m.allocate(2)
    assert m.cache_block(a, hs[0], toks) and not m.cache_block(b, hs[0], toks)
    assert not m.cache_block(a, hs[0], toks)
    off = KVCacheManager(4, False, block_size=BS, num_residual_slots=1)
    [c] = off.allocate(1)
    assert not off.cache_block(c, hs[0], toks) and off.lookup(hs) == [] and off.drain_events() == []
    assert off.get_computed_blocks(toks, hs) == ComputedBlocks([], 0) and off.queries == 0


def test_import_block_is_cached_and_free():
    m = KVCacheManager(3, block_size=BS)
    toks, hs = prompt(8, 7)
    first = m.import_block(hs[0], toks[:BS])
    second = m.import_block(hs[1], toks[BS:])
    assert (first, second) == (0, 1)
    assert m.import_block(hs[0], toks[:BS]) is None
    assert m.num_free_blocks == 3 and order(m.pool) == [2, 0, 1]
    assert m.lookup(hs, toks) == [0, 1]
    m.allocate(3)
    assert m.import_block(hs[0], toks[:BS]) is None is m.allocate_for_import()  # full of referenced pages
    with pytest.raises(RuntimeError, match="--kv-cache-memory"):
        m.allocate(1)


def test_usage_and_reset():
    m = KVCacheManager(4, block_size=BS)
    ids = m.allocate(3)
    assert m.usage == 0.75
    toks, hs = prompt(4, 8)
    m.cache_block(ids[0], hs[0], toks)
    assert not m.pool.reset_prefix_cache()
    m.free(ids)
    assert m.pool.reset_prefix_cache() and not m.contains(hs[0])


def test_check_integrity_catches_corruption():
    m = KVCacheManager(4, block_size=BS)
    ids = m.allocate(2)
    m.pool.blocks[ids[0]].ref_cnt = 0
    with pytest.raises(AssertionError, match=f"block {ids[0]} is not in the free queue"):
        m.pool.check_integrity()
    m2 = KVCacheManager(4, block_size=BS)
    m2.allocate(1)
    m2.pool.free_queue._head.next_free.ref_cnt = 1
    with pytest.raises(AssertionError, match="ref_cnt 1"):
        m2.pool.check_integrity()
    with pytest.raises(RuntimeError, match="freed more often"):
        m.free([ids[1], ids[1]])


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed * 7919 + random.randrange(1 << 30))
    m = KVCacheManager(24, block_size=BS, num_residual_slots=6)
    prompts = [prompt(rng.randrange(1, 30), rng.randrange(4)) for _ in range(6)]
    live: dict[str, tuple[list[int], int]] = {}  # request -> (tokens, computed)
    for step in range(300):
        op = rng.random()
        if op < 0.35 and len(live) < 6:
            rid = f"r{step}"
            toks, hs = prompts[rng.randrange(len(prompts))]
            toks = list(toks)
            comp = m.get_computed_blocks(toks, hs)
            before = (m.num_free_blocks, dict(m._requests))
            if m.allocate_slots(rid, len(toks) - comp.num_tokens, comp):
                live[rid] = (toks, len(toks))
                m.cache_full_blocks(rid, toks, block_hashes(toks, CTX), len(toks))
            else:
                assert (m.num_free_blocks, dict(m._requests)) == before
        elif op < 0.6 and live:
            rid = rng.choice(sorted(live))
            toks, n = live[rid]
            toks.append(rng.randrange(50000))
            if m.allocate_slots(rid, 1):
                live[rid] = (toks, n + 1)
                m.cache_full_blocks(rid, toks, block_hashes(toks, CTX), n + 1)
            else:
                toks.pop()
        elif op < 0.7 and live and len(live) < 6:
            parent = rng.choice(sorted(live))
            if m.fork_request(parent, f"f{step}"):
                live[f"f{step}"] = (list(live[parent][0]), live[parent][1])
        elif live:
            rid = rng.choice(sorted(live))
            m.free_request(rid)
            del live[rid]
        m.check_integrity()
        held = {}
        for rid in live:
            assert len(m.block_table(rid)) == live[rid][1] // BS
            for b in m.block_table(rid):
                held[b] = held.get(b, 0) + 1
        assert all(m.pool.blocks[b].ref_cnt == held.get(b, 0) for b in range(24))
        assert m.num_free_blocks == 24 - len(held)
    for rid in list(live):
        m.free_request(rid)
    m.check_integrity()
    assert m.num_free_blocks == 24
    stored = removed = 0
    for kind, _ in m.drain_events():
        stored += kind == "stored"
        removed += kind == "removed"
    assert stored - removed == len(m.pool.cached)
