"""Pages and residual slots to and from host bytes in one batch (`kv/host_copies.py`, `KVCache.copy_out`
/ `write_pages` / `write_slot`): the bytes are the pool's, in order, on the CPU and on a GPU, and on a
GPU neither direction waits for the kernels already queued."""
from __future__ import annotations

import time

import pytest
import torch

from kvmesh.kv.host_copies import HostCopy, bytes_to_device
from kvmesh.kv.layout import BlockLayout
from kvmesh.kv.pool import KVCache


def _cache(device: str, kv_dtype: str = "int4") -> KVCache:
    layout = BlockLayout(num_layers=2, kv_heads=2, head_dim=64, block_size=16, kv_dtype=kv_dtype)
    cache = KVCache(layout, num_blocks=12, num_residual_slots=3, model_dtype=torch.float16, device=device)
    cache.pool.copy_(torch.randint(0, 256, cache.pool.shape, dtype=torch.uint8))
    cache.residual.copy_(torch.randn(cache.residual.shape, dtype=torch.float16))
    return cache


def _round_trip(device: str) -> None:
    src, dst = _cache(device), _cache(device)
    ids = [7, 2, 11, 0]  # pages in random order
    copy = src.copy_out(ids, slot=1)
    pages, tail = copy.rows(0), copy.whole(1)
    assert [len(p) for p in pages] == [src.layout.block_bytes] * 4
    for p, b in zip(pages, ids):
        assert p == src.pool[b].cpu().numpy().tobytes()
    assert tail == src.residual[1].cpu().view(torch.uint8).numpy().tobytes()

    keep = dst.pool.clone()
    dst.write_pages([3, 9, 4, 1], pages)
    dst.write_slot(2, tail)
    for b, s in zip([3, 9, 4, 1], ids):
        assert torch.equal(dst.pool[b], src.pool[s])
    untouched = [b for b in range(12) if b not in (3, 9, 4, 1)]
    assert torch.equal(dst.pool[untouched], keep[untouched])
    assert torch.equal(dst.residual[2], src.residual[1])
    dst.write_pages([], [])  # nothing to import: no copy, no error
    with pytest.raises(ValueError, match="page is 5 bytes"):
        dst.write_pages([0], [b"short"])


def test_pages_and_slot_round_trip_on_the_cpu():
    _round_trip("cpu")


def test_empty_copy_and_typed_upload_on_the_cpu():
    cache = _cache("cpu")
    copy = cache.copy_out([], slot=0)
    assert copy.rows(0) == [] and len(copy.whole(1)) == cache.residual[0].numel() * 2
    assert copy.buffer(0).nbytes == 0 and copy.buffer(0).format == "B"  # a request that exports no page
    assert bytes(copy.buffer(1)) == copy.whole(1)
    x = torch.randn(3, 4, 5, dtype=torch.bfloat16)
    chunks = [x[i].view(torch.uint8).numpy().tobytes() for i in range(3)]
    assert torch.equal(bytes_to_device(chunks, torch.bfloat16, (4, 5), torch.device("cpu")), x)


@pytest.mark.gpu
def test_pages_and_slot_round_trip_on_the_gpu():
    _round_trip("cuda")


@pytest.mark.gpu
def test_copies_queue_behind_running_kernels_without_waiting():
    """With a ~200 ms kernel queued, building the copy and queueing the upload return at once; the
    bytes read afterwards are those the queued kernel left (stream order), not the older ones."""
    cache = _cache("cuda")
    torch.cuda.synchronize()
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.2)  # kHz -> 0.2 s of cycles
    torch.cuda._sleep(cycles)
    cache.pool[5].fill_(0xAB)  # runs after the sleep
    t0 = time.perf_counter()
    copy = cache.copy_out([5], slot=0)
    cache.write_pages([6], [bytes([0xCD]) * cache.layout.block_bytes])
    queued = time.perf_counter() - t0
    page = copy.rows(0)[0]
    waited = time.perf_counter() - t0
    assert queued < 0.05 < waited, (queued, waited)
    assert page == bytes([0xAB]) * cache.layout.block_bytes
    assert int(cache.pool[6].min()) == int(cache.pool[6].max()) == 0xCD
    assert isinstance(copy, HostCopy)
