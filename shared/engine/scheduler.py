"""Continuous batching: which sequences compute how many tokens this step, under the token budget,
the sequence cap and the KV pool; preemption by recompute when pages run out.

Running sequences go first (oldest first); when one cannot get the pages it needs, the newest
running sequence is preempted (its pages freed, its tokens recomputed later). Waiting sequences are
admitted only in steps without preemption, oldest first, after a prefix-cache lookup; where decode
steps run as CUDA graphs they are admitted in batches (`SchedulerLimits.batch_prefills`). Chunked
prefill: a prompt longer than what is left of the token budget computes a chunk and continues next
step. The scheduler sees block ids only as opaque handles from the KVCacheManager.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvmesh.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    enable_prefix_caching: bool
    batch_prefills: bool = False
    """Decode steps run as CUDA graphs (a GPU): a prompt joining running decodes turns the step into a
    prompt step (~4.7x a decode graph's time with prompt graphs, ~19x eager; SmolLM2, INT4 KV, in
    `benchmarks/gpu_serving.py`), so admissions wait to go in together (`_worth_a_step`)."""
    prefill_wait_steps: int = 32
    """With batch_prefills, the most steps a waiting request is held back while others decode."""
    growth_reserve: bool = True
    """Admit a prompt only where the pool keeps a free page for each running sequence's next block
    (a watermark that grows with the batch, where vLLM keeps 1 % of the pool): else the newest
    admission is the first preempted a few steps later, and its prefill is lost."""


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    """Tokens each sequence computes this step (in order of `seqs`)."""
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv, num_residual_slots: int,
                 load_tail: Callable[[Sequence], None]) -> None:
        """kv: the KVCacheManager (opaque block handles). load_tail: copies a resumed sequence's
        tail bytes into its residual slot once it has one."""
        self.limits = limits
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(num_residual_slots - 1, -1, -1))
        self._load_tail = load_tail
        self.num_preemptions = 0
        self._held_steps = 0  # consecutive steps that held waiting requests back (batch_prefills)

    # ---- queue ----
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, slot: int) -> None:
        """A forked child: already holds pages (shared) and a reserved slot."""
        seq.residual_slot = slot
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _seats(self, seq: Sequence) -> int:
        """Sequence slots a waiting sequence takes when admitted (n for an unforked parent)."""
        r = seq.request
        return 1 if r.forked or r.params.n == 1 else r.params.n

    def _running_seats(self) -> int:
        return sum(self._seats(s) for s in self.running)

    # ---- per step ----
    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.limits.max_num_batched_tokens
        bs = self.limits.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.stops_after_pending:  # its step in flight samples its last token
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = (seq.num_computed_tokens + num_new) // bs - len(seq.block_ids)
            while need > 0 and self.kv.num_free_blocks < need:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: nothing after it is running either
            if need > 0:
                seq.block_ids.extend(self.kv.allocate(need))
            out.seqs.append(seq)
            out.num_new.append(num_new)
            budget -= num_new
            i += 1

        if self.waiting and budget > 0 and not out.preempted and not self._worth_a_step(out, budget):
            self._held_steps += 1
            return out
        self._held_steps = 0
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            seats = self._seats(seq)
            if self._running_seats() + seats > self.limits.max_num_seqs or len(self._free_slots) < seats:
                break
            num_new = self._admit(seq, budget)
            if num_new == 0:
                break  # not enough pages: wait for running sequences to finish
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.residual_slot = self._free_slots.pop()
            seq.request.reserved_slots = [self._free_slots.pop() for _ in range(seats - 1)]
            if seq.resume_tail is not None:
                self._load_tail(seq)
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new.append(num_new)
            budget -= num_new
        return out

    def _worth_a_step(self, out: ScheduledBatch, budget: int) -> bool:
        """With batch_prefills: whether to admit waiting requests into this step now. Yes where nothing
        decodes, where the step is a prompt step anyway (a prompt chunk in it), where the oldest
        waiting request has been held prefill_wait_steps, and where the pool and seats already take
        enough waiting requests at once: running // 4 of them (at least one), or a full token budget.
        So a lightly loaded engine admits at once, and a loaded one pays one prompt step for a batch
        of prompts instead of one a prompt. (A prompt step costs E decode steps; holding k seats
        empty costs k / running of a step, each step; with completions every G / running steps for G
        tokens a request, the two balance at k ~ running * sqrt(2 E / G): 0.3 running at E 4.7-5.5
        (prompt graphs), 0.4-0.5 at E 10-17 (eager), G 128. A quarter leaves room for shorter
        generations.) Counted without prefix hits (they only need fewer pages)."""
        if not self.limits.batch_prefills or not out.seqs or max(out.num_new) > 1:
            return True
        if self._held_steps >= self.limits.prefill_wait_steps:
            return True
        target, count, tokens = max(1, len(out.seqs) // 4), 0, 0
        pages, seats = self.kv.num_free_blocks, self.limits.max_num_seqs - self._running_seats()
        slots = len(self._free_slots)
        for seq in self.waiting:
            n, need = self._seats(seq), seq.num_tokens // self.limits.block_size + 1
            if n > min(seats, slots) or need + self._reserve(count) > pages:
                return False
            count, tokens = count + 1, tokens + seq.num_tokens
            if count >= target or tokens >= budget:
                return True
            pages, seats, slots = pages - need, seats - n, slots - n
        return False

    def _reserve(self, admitted: int = 0) -> int:
        """Free pages an admission must leave (`growth_reserve`): one for each running sequence's next
        block, counting `admitted` more about to run."""
        return len(self.running) + admitted if self.limits.growth_reserve else 0

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Prefix lookup and page allocation for a waiting sequence; returns tokens to compute
        this step, or 0 (nothing taken) when the pool cannot hold them yet."""
        bs = self.limits.block_size
        req = seq.request
        hits: list[int] = []
        resumed = seq.resume_tail is not None
        # A resumed sequence reads its imported blocks through the cache even when caching is off.
        use_cache = (self.limits.enable_prefix_caching or resumed) and not req.skip_prefix_cache
        if use_cache:
            # Always compute at least one token (its logits give the next token), so the last
            # block that contains the final known token is never taken from the cache.
            max_blocks = (seq.num_tokens - 1) // bs
            hits = self.kv.lookup(seq.block_hashes[:max_blocks], seq.token_ids)
        computed = len(hits) * bs
        if resumed and len(hits) == seq.num_prompt_tokens // bs:
            computed = seq.num_prompt_tokens  # full prompt blocks + the imported tail
        elif resumed:
            seq.resume_tail = None  # a block went missing: recompute, like a preemption
        num_new = min(seq.num_tokens - computed, budget)
        need = (computed + num_new) // bs - len(hits)
        if not self.kv.can_allocate(need + self._reserve(), hits):
            return 0
        seq.block_ids = self.kv.take(hits) + self.kv.allocate(need)
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = computed
        if use_cache:
            self.kv.record_query(seq.num_tokens if not resumed else seq.num_prompt_tokens, computed)
        if seq.num_preemptions == 0 and seq.index == 0:
            req.num_cached_tokens = computed
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.kv.free(seq.block_ids)
        seq.block_ids = []
        seq.num_cached_blocks = 0
        if seq.residual_slot is not None:
            self._free_slots.append(seq.residual_slot)
            seq.residual_slot = None
        if seq.request.reserved_slots and not seq.request.forked:
            self._free_slots.extend(seq.request.reserved_slots)
            seq.request.reserved_slots = []

    def return_slots(self, slots: list[int]) -> None:
        self._free_slots.extend(slots)

    def finish(self, seq: Sequence) -> None:
        """Frees a finished or aborted sequence's pages and slot at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._release(seq)
        seq.status = Status.FINISHED
