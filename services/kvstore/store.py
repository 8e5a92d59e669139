"""BlockStore: content-addressed KV blocks in a preallocated pool, with leases, LRU and a host tier.

Two tiers, each a Slab plus an LRU-ordered map (first = least recently used):
    primary  GPU memory when present, host memory otherwise (--capacity-bytes)
    host     optional host-memory tier below it (--host-tier-bytes)
When a put would push the primary tier over --high-watermark, unleased blocks are evicted in LRU order
until it is down to --low-watermark; an evicted block demotes to the host tier when there is one (the
host tier evicts its own LRU blocks for good). A get that hits the host tier promotes the block back.
Leased blocks are never evicted. Every block that enters or finally leaves the store is queued as an
event for the index publisher; a block moving between tiers is still held and is not an event.
Single-threaded by design: the gRPC server calls it from one event loop. `get_many` reads the
primary tier's blocks of a request in one copy (`Slab.copy_out`) whose device-to-host half may wait
in a worker thread: by then the bytes are a private copy, and the store is not touched.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from kvmesh.kvstore import checksum
from kvmesh.kvstore.block import StoredBlock
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.leases import LeaseTable
from kvmesh.kvstore.slab import Slab, SlotCopy, resolve_device


class PutResult(Enum):
    STORED = "stored"
    ALREADY_HELD = "already_held"
    REJECTED = "rejected"  # no room even after eviction: every block is leased


class ChecksumError(ValueError):
    pass


@dataclass(frozen=True)
class _Entry:
    slot: int
    size: int
    crc32: int
    layout: str
    token_ids: tuple[int, ...]

    def block(self, block_hash: bytes, data) -> StoredBlock:
        return StoredBlock(block_hash, list(self.token_ids), data, self.layout, crc32=self.crc32)


class BlockReads:
    """What `BlockStore.get_many` found, per hash: a block, None, or (hash, entry, row) of a primary-tier
    block whose bytes are row `row` of one `SlotCopy` until `blocks()` (which waits for that copy
    when `waits`: call it off the event loop)."""

    def __init__(self, items: list, copy: SlotCopy | None) -> None:
        self._items = items
        self._copy = copy

    @property
    def waits(self) -> bool:
        return self._copy is not None and self._copy.waits

    def blocks(self) -> list[StoredBlock | None]:
        views = self._copy.views() if self._copy is not None else []
        return [x[1].block(x[0], views[x[2]]) if isinstance(x, tuple) else x for x in self._items]

    async def gather(self) -> list[StoredBlock | None]:
        """`blocks()`, its wait for the GPU copy in a worker thread, so the event loop goes on."""
        return await asyncio.to_thread(self.blocks) if self.waits else self.blocks()


@dataclass(frozen=True)
class StoreStats:
    blocks_held: int
    capacity_blocks: int
    blocks_evicted: int
    bytes_in: int
    bytes_out: int
    host_tier_blocks: int
    host_tier_capacity_blocks: int
    blocks_demoted: int
    blocks_promoted: int
    blocks_rejected: int
    blocks_leased: int
    slot_bytes: int
    device: str


class _Tier:
    """One slab and the LRU order of the blocks in it."""

    def __init__(self, slab: Slab) -> None:
        self.slab = slab
        self.lru: OrderedDict[bytes, _Entry] = OrderedDict()


class BlockStore:
    def __init__(self, cfg: KVStoreConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.leases = LeaseTable(cfg.lease_seconds, clock)
        self._primary: _Tier | None = None
        self._host: _Tier | None = None
        self._events: dict[bytes, bool] = {}  # hash -> stored (True) / removed (False), in event order
        self._evicted = self._demoted = self._promoted = self._rejected = 0
        self._bytes_in = self._bytes_out = 0
        if cfg.block_bytes is not None:
            self.allocate(cfg.block_bytes)

    # -- sizing -------------------------------------------------------------------------------
    def allocate(self, slot_bytes: int) -> None:
        """Preallocate both tiers once the slot size is known (flag, or the first block put). A host
        slab's pages are touched here, seconds a GiB, so the server runs this in a thread (nothing
        else in the store changes meanwhile: both tiers appear at once, at the end)."""
        cfg = self.cfg
        n = cfg.capacity_blocks if cfg.capacity_blocks is not None else cfg.capacity_bytes // slot_bytes
        if n < 1:
            raise ValueError(f"--capacity-bytes ({cfg.capacity_bytes}) holds no block of {slot_bytes} bytes")
        host_n = cfg.host_tier_bytes // slot_bytes
        primary = _Tier(Slab(n, slot_bytes, self.device))
        host = _Tier(Slab(host_n, slot_bytes, "cpu")) if host_n > 0 else None
        self._primary, self._host = primary, host

    @property
    def capacity_blocks(self) -> int:
        return self._primary.slab.num_slots if self._primary else 0

    @property
    def slot_bytes(self) -> int | None:
        return self._primary.slab.slot_bytes if self._primary else None

    def _watermarks(self) -> tuple[int, int]:
        cap = self.capacity_blocks
        high = max(1, int(cap * self.cfg.high_watermark))
        low = min(int(cap * self.cfg.low_watermark), high - 1)
        return high, low

    # -- writes -------------------------------------------------------------------------------
    def put(self, block_hash: bytes, data: bytes | bytearray | memoryview, token_ids: list[int] | tuple[int, ...],
            layout: str, crc32: int | None = None) -> PutResult:
        """Store one block; `crc32`, when given, must match the data (ChecksumError otherwise)."""
        crc = checksum.crc32(data)
        if crc32 is not None and crc != crc32:
            raise ChecksumError(f"block {block_hash.hex()[:16]}: crc32 {crc:#010x} != header {crc32:#010x}")
        if self._primary is None:
            self.allocate(len(data))
        if len(data) > self.slot_bytes:
            raise ValueError(f"block {block_hash.hex()[:16]} has {len(data)} bytes; slots hold "
                             f"{self.slot_bytes} (set --block-bytes to the largest block size)")
        for tier in self._tiers():
            if block_hash in tier.lru:
                tier.lru.move_to_end(block_hash)
                return PutResult.ALREADY_HELD
        entry = _Entry(-1, len(data), crc, layout, tuple(token_ids))
        if self._insert(self._primary, block_hash, entry, data) or (
                self._host is not None and self._insert(self._host, block_hash, entry, data)):
            self._bytes_in += len(data)
            self._event(block_hash, True)
            return PutResult.STORED
        self._rejected += 1
        return PutResult.REJECTED

    def flush(self) -> None:
        """Sends the blocks put so far on their way into GPU memory (a put call's end: on the GPU a
        put stages its bytes and a call's blocks travel in one copy; every read flushes first)."""
        if self._primary is not None:
            self._primary.slab.flush()

    def _insert(self, tier: _Tier, block_hash: bytes, entry: _Entry, data) -> bool:
        """Make room in `tier` (evicting by LRU), then copy the block into a free slot."""
        self._make_room(tier)
        slot = tier.slab.alloc()
        if slot is None:
            return False
        tier.slab.write(slot, data)
        tier.lru[block_hash] = _Entry(slot, entry.size, entry.crc32, entry.layout, entry.token_ids)
        return True

    def _make_room(self, tier: _Tier) -> None:
        if tier is self._primary:
            high, low = self._watermarks()
        else:  # the host tier evicts only as much as it needs: one slot
            high, low = tier.slab.num_slots, tier.slab.num_slots - 1
        if len(tier.lru) + 1 <= high:
            return
        for block_hash in list(tier.lru):  # least recently used first
            if len(tier.lru) <= low:
                break
            if not self.leases.is_leased(block_hash):
                self._evict(tier, block_hash)

    def _evict(self, tier: _Tier, block_hash: bytes) -> None:
        entry = tier.lru.pop(block_hash)
        if tier is self._primary and self._host is not None:
            data = tier.slab.read(entry.slot, entry.size)
            tier.slab.free(entry.slot)
            if self._insert(self._host, block_hash, entry, data):
                self._demoted += 1
                return
        else:
            tier.slab.free(entry.slot)
        self._drop(block_hash)

    def _drop(self, block_hash: bytes) -> None:
        self.leases.forget(block_hash)
        self._evicted += 1
        self._event(block_hash, False)

    def _event(self, block_hash: bytes, stored: bool) -> None:
        self._events.pop(block_hash, None)  # keep event order: the latest state goes last
        self._events[block_hash] = stored

    # -- reads --------------------------------------------------------------------------------
    def lease(self, hashes: list[bytes], holder: str, seconds: float) -> None:
        """Lease the held ones of `hashes` to `holder` (before a get streams them)."""
        if seconds <= 0:
            return
        for h in hashes:
            if self._find(h) is not None:
                self.leases.grant(h, holder or "anonymous", seconds)

    def get(self, block_hash: bytes, lease_holder: str = "", lease_seconds: float = 0.0) -> StoredBlock | None:
        """The block (a copy), or None. Marks it most recently used and promotes it from the host tier."""
        found = self._find(block_hash)
        if found is None:
            return None
        tier, entry = found
        self.leases.grant(block_hash, lease_holder or "anonymous", lease_seconds)
        data = tier.slab.read(entry.slot, entry.size)
        if tier is self._host:
            self._promote(block_hash, entry, data)
        else:
            tier.lru.move_to_end(block_hash)
        self._bytes_out += entry.size
        return entry.block(block_hash, data)

    def get_many(self, hashes: list[bytes], lease_holder: str = "", lease_seconds: float = 0.0) -> BlockReads:
        """`get` for each hash, the primary tier's blocks in one copy, taken (queued, on the GPU)
        before any host-tier hit is promoted: a promotion may evict an unleased block of this very
        request and reuse its slot. A repeated hash is read once."""
        found = {h: self._find(h) for h in hashes}  # unique, in order
        primary = [(h, f[1]) for h, f in found.items() if f is not None and f[0] is self._primary]
        copy = (self._primary.slab.copy_out([e.slot for _, e in primary], [e.size for _, e in primary])
                if primary else None)
        items: dict[bytes, StoredBlock | tuple | None] = {}
        for row, (h, entry) in enumerate(primary):
            self.leases.grant(h, lease_holder or "anonymous", lease_seconds)
            self._primary.lru.move_to_end(h)
            self._bytes_out += entry.size
            items[h] = (h, entry, row)
        # host-tier hits and misses one at a time, each found again: promoting one may drop another
        for h in found:
            if h not in items:
                items[h] = self.get(h, lease_holder, lease_seconds)
        return BlockReads([items[h] for h in hashes], copy)

    def _promote(self, block_hash: bytes, entry: _Entry, data: bytes) -> None:
        # Free the host slot first so that blocks the primary demotes to make room can land there.
        self._host.lru.pop(block_hash)
        self._host.slab.free(entry.slot)
        if self._insert(self._primary, block_hash, entry, data):
            self._promoted += 1
        elif not self._insert(self._host, block_hash, entry, data):
            self._drop(block_hash)  # cannot happen: we just freed a host slot; kept for safety

    def contains(self, hashes: list[bytes]) -> list[bool]:
        """Which blocks are held (either tier). Touches neither LRU order nor leases."""
        return [self._find(h) is not None for h in hashes]

    def release(self, hashes: list[bytes], holder: str) -> int:
        return sum(self.leases.release(h, holder or "anonymous") for h in hashes)

    def _find(self, block_hash: bytes) -> tuple[_Tier, _Entry] | None:
        for tier in self._tiers():
            entry = tier.lru.get(block_hash)
            if entry is not None:
                return tier, entry
        return None

    def _tiers(self) -> list[_Tier]:
        return [t for t in (self._primary, self._host) if t is not None]

    # -- bookkeeping --------------------------------------------------------------------------
    def lru_order(self, tier: str = "primary") -> list[bytes]:
        """Hashes of a tier, least recently used first."""
        t = self._primary if tier == "primary" else self._host
        return list(t.lru) if t is not None else []

    def held_hashes(self) -> list[bytes]:
        return [h for t in self._tiers() for h in t.lru]

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) since the last call; a block is in at most one list (its latest state)."""
        events, self._events = self._events, {}
        return [h for h, s in events.items() if s], [h for h, s in events.items() if not s]

    def stats(self) -> StoreStats:
        p, h = self._primary, self._host
        return StoreStats(
            blocks_held=len(self.held_hashes()), capacity_blocks=self.capacity_blocks,
            blocks_evicted=self._evicted, bytes_in=self._bytes_in, bytes_out=self._bytes_out,
            host_tier_blocks=len(h.lru) if h else 0, host_tier_capacity_blocks=h.slab.num_slots if h else 0,
            blocks_demoted=self._demoted, blocks_promoted=self._promoted, blocks_rejected=self._rejected,
            blocks_leased=self.leases.count(), slot_bytes=p.slab.slot_bytes if p else 0, device=self.device)

    def check_integrity(self) -> None:
        """Every slot is either free or owned by exactly one block; raises AssertionError otherwise."""
        for t in self._tiers():
            used = [e.slot for e in t.lru.values()]
            free = list(t.slab._free)
            if sorted(used + free) != list(range(t.slab.num_slots)):
                raise AssertionError(f"slot accounting broken: {len(used)} used + {len(free)} free "
                                     f"!= {t.slab.num_slots} slots")
        if self._primary and self._host and set(self._primary.lru) & set(self._host.lru):
            raise AssertionError("a block is in both tiers")
