"""KVCacheManager: what the scheduler sees of the KV cache (block ids as opaque handles, no tensors).

Two levels over one `BlockPool`:
  - block level (the engine's scheduler holds its own block lists): lookup / can_allocate / take /
    allocate / free / fork / cache_block / allocate_for_import;
  - request level (the manager holds the lists, keyed by request id): get_computed_blocks /
    allocate_slots / free_request / fork_request / cache_full_blocks, plus one residual slot per
    running request.
Prefix-cache counters are in tokens, like vLLM's `prefix_cache_queries` / `prefix_cache_hits`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from kvmesh.hashing import BlockHash
from kvmesh.kv.block_pool import BlockPool, KVBlock


class ComputedBlocks(NamedTuple):
    """A request's longest cached prefix: its pages, and how many tokens they cover."""

    block_ids: list[int]
    num_tokens: int


@dataclass
class _RequestKV:
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    """Leading blocks already registered in the prefix cache."""
    num_tokens: int = 0
    """Tokens whose pages (or residual slot) this request holds room for."""
    residual_slot: int | None = None


class KVCacheManager:
    """Prefix matching, allocation, freeing and forking of KV pages over one BlockPool."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, *, block_size: int | None = None,
                 num_residual_slots: int = 0) -> None:
        """block_size is needed by the request-level API and token checks; the block-level API
        works without it (the caller then owns the token arithmetic)."""
        self.pool = BlockPool(num_blocks, enable_caching)
        self._block_size = block_size
        self.queries = 0
        """Prompt tokens looked up in the prefix cache."""
        self.hits = 0
        """Of those, tokens served from it."""
        self._requests: dict[str, _RequestKV] = {}
        self._free_slots = list(range(num_residual_slots - 1, -1, -1))  # pop() hands out slot 0 first

    # ---- queries ----
    @property
    def block_size(self) -> int:
        if self._block_size is None:
            raise ValueError("KVCacheManager(block_size=...) is required for token-level calls")
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def usage(self) -> float:
        """Fraction of pages referenced (vLLM's kv_cache_usage_perc, as a fraction)."""
        return self.pool.usage

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.pool.cached

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for rid, r in self._requests.items():
            for b in r.block_ids:
                held[b] = held.get(b, 0) + 1
        for bid, n in held.items():
            if self.pool.blocks[bid].ref_cnt < n:
                raise AssertionError(f"block {bid} held by {n} requests but ref_cnt {self.pool.blocks[bid].ref_cnt}")

    def drain_events(self) -> list[tuple[str, BlockHash]]:
        """("stored" | "removed", block hash) since the last call, in order."""
        return self.pool.take_events()

    # ---- block level ----
    def lookup(self, block_hashes: Sequence[BlockHash],
               token_ids: Sequence[int] | None = None) -> list[int]:
        """Ids of the longest run of cached blocks matching `block_hashes` from the start (nothing
        is taken). With `token_ids`, each hit's stored tokens must equal the block's tokens too."""
        if not self.pool.enable_caching:
            return []
        bs = self.block_size if token_ids is not None else 0
        out = []
        for i, h in enumerate(block_hashes):
            toks = None if token_ids is None else token_ids[i * bs:(i + 1) * bs]
            b = self.pool.get_cached_block(h, toks)
            if b is None:
                break
            out.append(b.block_id)
        return out

    def can_allocate(self, num_new: int, hits: Sequence[int] = ()) -> bool:
        """Whether `num_new` fresh pages fit after taking `hits` (free hits leave the free queue)."""
        free_hits = sum(1 for b in hits if self.pool.blocks[b].ref_cnt == 0)
        return num_new <= self.pool.num_free_blocks - free_hits

    def take(self, block_ids: Sequence[int]) -> list[int]:
        """Adds a reference to each (prefix hits); returns the ids."""
        self.pool.touch([self.pool.blocks[b] for b in block_ids])
        return list(block_ids)

    fork = take  # children of an n > 1 request share the parent's pages

    def allocate(self, n: int) -> list[int]:
        """n fresh pages (ref_cnt 1), evicting the least recently freed cached pages."""
        return [b.block_id for b in self.pool.get_new_blocks(n)]

    def allocate_for_import(self) -> int | None:
        """One page for an imported block (write it, then `cache_block`, then `free`), or None."""
        return self.allocate(1)[0] if self.pool.num_free_blocks else None

    def free(self, block_ids: Sequence[int]) -> None:
        """Drops a sequence's references, last block first (its tail is evicted first)."""
        self.pool.free_blocks([self.pool.blocks[b] for b in reversed(block_ids)])

    def cache_block(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Registers a full, written page in the prefix cache (False if not cached, see BlockPool)."""
        want = self._block_size
        if (want is not None and len(token_ids) != want) or not token_ids:
            raise ValueError(f"token_ids must hold block_size={want} ids, got {len(token_ids)}")
        return self.pool.cache_block(self.pool.blocks[block_id], block_hash, token_ids)

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_query_tokens
        self.hits += num_hit_tokens

    def import_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """Makes room for an externally computed page as a cached, free block. Returns the page id
        the caller must fill with the block's bytes now, or None (already cached, or no free page)."""
        if not self.pool.enable_caching or self.contains(block_hash):
            return None
        bid = self.allocate_for_import()
        if bid is None:
            return None
        self.cache_block(bid, block_hash, token_ids)
        self.free([bid])
        return bid

    # ---- request level ----
    def get_computed_blocks(self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> ComputedBlocks:
        """Longest cached prefix of a prompt, always leaving at least one token to compute (its
        logits give the next token). Counts the query; takes nothing."""
        if not self.pool.enable_caching:
            return ComputedBlocks([], 0)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits = self.lookup(block_hashes[:max_blocks], token_ids)
        self.record_query(len(token_ids), len(hits) * self.block_size)
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def allocate_slots(self, request_id: str, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> bool:
        """Room for `num_new_tokens` more tokens of a request (the first call may bring its cached
        prefix). False = not enough pages or residual slots; nothing changed then."""
        r = self._requests.get(request_id)
        new_request = r is None
        if new_request:
            if not self._free_slots:
                return False
            r = _RequestKV()
        hits = computed.block_ids if (computed and new_request) else []
        start = computed.num_tokens if (computed and new_request) else r.num_tokens
        need = (start + num_new_tokens) // self.block_size - len(r.block_ids) - len(hits)
        if not self.can_allocate(max(need, 0), hits):
            return False
        r.block_ids += self.take(hits) + self.allocate(max(need, 0))
        r.num_tokens = start + num_new_tokens
        if new_request:
            r.num_cached_blocks = len(hits)
            r.residual_slot = self._free_slots.pop()
            self._requests[request_id] = r
        return True

    def block_table(self, request_id: str) -> list[int]:
        return list(self._req(request_id).block_ids)

    def residual_slot(self, request_id: str) -> int:
        return self._req(request_id).residual_slot

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int],
                          block_hashes: Sequence[BlockHash], num_computed_tokens: int) -> int:
        """After a step: registers the request's newly full blocks (prompt or generated tokens).
        Returns how many blocks it registered."""
        r = self._req(request_id)
        full = min(num_computed_tokens // self.block_size, len(block_hashes), len(r.block_ids))
        bs = self.block_size
        new = 0
        for b in range(r.num_cached_blocks, full):
            new += self.cache_block(r.block_ids[b], block_hashes[b], token_ids[b * bs:(b + 1) * bs])
        r.num_cached_blocks = max(r.num_cached_blocks, full)
        return new

    def fork_request(self, parent_id: str, child_id: str) -> bool:
        """A child sharing every page of the parent (n > 1), with its own residual slot (the caller
        copies the slot's contents). False = no residual slot free."""
        p = self._req(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request id {child_id!r} already holds KV blocks")
        if not self._free_slots:
            return False
        self._requests[child_id] = _RequestKV(self.fork(p.block_ids), p.num_cached_blocks, p.num_tokens,
                                              self._free_slots.pop())
        return True

    def free_request(self, request_id: str) -> None:
        """Frees a finished, aborted or preempted request's pages (tail first) and residual slot."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return
        self.free(r.block_ids)
        if r.residual_slot is not None:
            self._free_slots.append(r.residual_slot)

    def _req(self, request_id: str) -> _RequestKV:
        r = self._requests.get(request_id)
        if r is None:
            raise KeyError(f"request {request_id!r} holds no KV blocks")
        return r


__all__ = ["ComputedBlocks", "KVCacheManager", "KVBlock"]
