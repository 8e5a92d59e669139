"""BlockPool: the allocator under the KV cache manager (after vLLM v1's block pool).

Every page of the pool is a `KVBlock` with a reference count. Blocks nobody references sit in a
doubly linked free queue threaded through the blocks themselves, so a prefix-cache hit takes a block
out of the middle in O(1). A free block may still hold a cached (hashed) page: it is reusable, and
allocation evicts from the queue's head (least recently freed), dropping the block's hash. Callers
free a finished sequence's blocks tail first, so the tail of a prompt is evicted before its head
(a later request more likely shares the head). Hash hits compare the stored token ids too.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from kvmesh.hashing import BlockHash


class KVBlock:
    """One page: id, reference count, its cached identity, and free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks between two sentinels; head = evicted first."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        b = self._head.next_free
        if b is self._tail:
            raise IndexError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: KVBlock) -> None:
        if b.prev_free is None or b.next_free is None:
            raise ValueError(f"block {b.block_id} is not in the free queue")
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def append(self, b: KVBlock) -> None:
        if b.prev_free is not None or b.next_free is not None:
            raise ValueError(f"block {b.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = b
        b.prev_free = last
        b.next_free = self._tail
        self._tail.prev_free = b
        self.num_free += 1

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[KVBlock]:
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """Blocks, ref counts, the free queue, the hash -> block map, and the stored/removed events."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}; increase --kv-cache-memory")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.events: list[tuple[str, BlockHash]] = []

    # ---- queries ----
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (some may still hold an evictable cached page)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int] | None = None) -> KVBlock | None:
        """The block cached under `block_hash`, if its token ids match (when given)."""
        b = self.cached.get(block_hash)
        if b is None or (token_ids is not None and b.token_ids != tuple(token_ids)):
            return None
        return b

    # ---- allocation ----
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """n blocks from the head of the free queue, evicting their cached pages; ref_cnt = 1."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free; the scheduler "
                               "must check first (or increase --kv-cache-memory)")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Adds a reference to each block (a prefix hit or a fork); free ones leave the queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered: Sequence[KVBlock]) -> None:
        """Drops one reference from each block; blocks reaching 0 join the queue's tail in the
        given order (pass a sequence's blocks reversed, so its tail is evicted first)."""
        for b in ordered:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"block {b.block_id} freed more often than taken")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    # ---- prefix cache ----
    def cache_block(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Registers a full block's identity. False when caching is off, the block is already
        cached, or another block holds the same hash (a duplicate computed concurrently)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        self.events.append(("stored", block_hash))
        return True

    def _evict(self, b: KVBlock) -> None:
        if b.block_hash is None:
            return
        del self.cached[b.block_hash]
        self.events.append(("removed", b.block_hash))
        b.block_hash = None
        b.token_ids = None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached page; only when no block is referenced (like vLLM's reset)."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in list(self.cached.values()):
            self._evict(b)
        return True

    def take_events(self) -> list[tuple[str, BlockHash]]:
        out, self.events = self.events, []
        return out

    # ---- invariants ----
    def check_integrity(self) -> None:
        """Raises AssertionError naming the first broken invariant."""
        seen = set()
        prev = self.free_queue._head
        for b in self.free_queue:
            if b.prev_free is not prev:
                raise AssertionError(f"free queue back link broken at block {b.block_id}")
            if b.block_id in seen:
                raise AssertionError(f"block {b.block_id} twice in the free queue")
            if b.ref_cnt != 0:
                raise AssertionError(f"block {b.block_id} in the free queue with ref_cnt {b.ref_cnt}")
            seen.add(b.block_id)
            prev = b
        if self.free_queue._tail.prev_free is not prev:
            raise AssertionError("free queue tail link broken")
        if len(seen) != self.free_queue.num_free:
            raise AssertionError(f"free count {self.free_queue.num_free} != {len(seen)} blocks in the queue")
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise AssertionError(f"block {b.block_id} has ref_cnt {b.ref_cnt}")
            if b.ref_cnt == 0 and b.block_id not in seen:
                raise AssertionError(f"unreferenced block {b.block_id} is not in the free queue")
            if b.ref_cnt > 0 and (b.prev_free is not None or b.next_free is not None):
                raise AssertionError(f"referenced block {b.block_id} still linked in the free queue")
            if b.block_hash is not None and self.cached.get(b.block_hash) is not b:
                raise AssertionError(f"block {b.block_id} has a hash the map does not point back to")
        for h, b in self.cached.items():
            if b.block_hash != h or b.token_ids is None:
                raise AssertionError(f"hash map entry {h.hex()[:8]} points at block {b.block_id} of another hash")
