"""BlockStore.get_many: a request's primary-tier blocks in one copy (`Slab.copy_out`), taken before any
host-tier hit of the same request is promoted, so a promotion that evicts one of them and reuses its
slot cannot change the bytes the request gets."""
from __future__ import annotations

import pytest
import torch

from test_kvstore_store import blocks, make, put_all


def setup_store(device: str):
    """Primary 2 slots (down to 1 on a put past them), host tier 3: A, D on the host tier, B, C held."""
    store = make(capacity_blocks=2, host_tier_bytes=3 * 4096, low_watermark=0.5, device=device)
    (a, da, _), (b, db, _), (c, dc, _), (d, dd, _) = bs = blocks(4)
    put_all(store, [bs[0], bs[3]])  # a, d
    put_all(store, [bs[1]])  # a demoted, then d
    put_all(store, [bs[2]])
    assert store.lru_order() == [b, c] and set(store.lru_order("host")) == {a, d}
    return store, bs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_promotions_in_the_same_request_cannot_change_its_bytes(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    store, bs = setup_store(device)
    (a, da, ta), (b, db, tb), (c, dc, tc), (d, dd, td) = bs
    reads = store.get_many([b, a, d])  # no leases: promoting a evicts c, promoting d evicts b and reuses its slot
    assert reads.waits == (device == "cuda")
    got = reads.blocks()
    assert b not in store.lru_order()  # b's slot was handed on inside this request
    assert [(g.hash, bytes(g.data), g.token_ids) for g in got] == [(b, db, tb), (a, da, ta), (d, dd, td)]
    store.check_integrity()
    for h, data, _ in bs:  # and every block is still whole wherever it went
        assert bytes(store.get(h).data) == data


def test_missing_repeated_and_counted():
    store = make(capacity_blocks=4)
    bs = blocks(3, 3000)
    put_all(store, bs)
    (a, da, _), (b, db, _), _ = bs
    gone = bytes(32)
    before = store.stats().bytes_out
    got = store.get_many([a, gone, b, a], "w", 30.0).blocks()
    assert got[1] is None
    assert [bytes(g.data) for g in (got[0], got[2], got[3])] == [da, db, da]
    assert store.stats().bytes_out - before == 2 * 3000  # a repeated hash is read (and counted) once
    assert store.lru_order()[-2:] == [a, b]
    assert store.leases.is_leased(a) and store.leases.is_leased(b)
    assert store.get_many([]).blocks() == []
