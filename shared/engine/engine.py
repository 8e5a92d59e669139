"""LLMEngine: requests in, one scheduled and computed step at a time, RequestOutputs out.

Single-threaded by design (AsyncEngine runs it in one background thread). Per step: the scheduler
picks sequences and token counts, the runner computes them, new full blocks enter the prefix cache,
the sampler picks tokens, stop conditions are checked and finished sequences free their pages.
With async scheduling (`inflight.py`) a step without prompt logprobs is launched before the step
before it is read back, and that step's stop checks and outputs run while the GPU computes.
"""
from __future__ import annotations

import itertools
from typing import Any, Optional

import torch

from kvmesh.config import EngineConfig
from kvmesh.engine.detokenizer import Detokenizer
from kvmesh.engine.inflight import InFlightStep
from kvmesh.engine.outputs import ExportedBlock, KVExport, OutputKind, RequestOutput, ResumeState, TokenLogprob
from kvmesh.engine.request_checks import RequestLimits, check_request
from kvmesh.engine.runner import ModelRunner
from kvmesh.engine.sampler import SampleRow, Sampler, prompt_logprobs
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import ScheduledBatch, Scheduler, SchedulerLimits
from kvmesh.engine.sequence import Request, Sequence
from kvmesh.engine.step_plan import StepPlan, plan_step
from kvmesh.engine.stats import EngineStats
from kvmesh.hashing import HashContext
from kvmesh.kv.host_copies import to_device
from kvmesh.kv.kv_cache_manager import KVCacheManager
from kvmesh.model.config import model_identity
from kvmesh.model.tokenizer import Tokenizer

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n completions apart


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        sc = config.scheduler
        self.runner = ModelRunner(config, num_residual_slots=sc.max_num_seqs)
        self.model_config = self.runner.model_config
        self.layout = self.runner.layout
        self.tokenizer = Tokenizer.from_model(config.model)
        self.model_id = model_identity(config.model)
        ctx = self.model_config.max_position_embeddings
        if sc.max_model_len is not None and sc.max_model_len > ctx:
            raise ValueError(f"--max-model-len {sc.max_model_len} exceeds the model's context length {ctx}")
        self.max_model_len = sc.max_model_len or ctx
        self.kv = KVCacheManager(self.runner.cache.num_blocks, config.cache.enable_prefix_caching,
                                 block_size=self.layout.block_size)
        limits = SchedulerLimits(sc.max_num_seqs, sc.max_num_batched_tokens, self.max_model_len,
                                 self.layout.block_size, config.cache.enable_prefix_caching,
                                 batch_prefills=self.runner.graphs is not None)
        self.scheduler = Scheduler(limits, self.kv, sc.max_num_seqs, self._load_tail)
        self.sampler = Sampler(config.seed, self.runner.device, self.runner.native)
        self._requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._eos = frozenset(self.model_config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._computed_tokens = 0
        self.async_scheduling = sc.async_scheduling if sc.async_scheduling is not None \
            else self.runner.graphs is not None
        self._inflight: Optional[InFlightStep] = None
        self._async_steps = 0
        self.export_space: Optional[Any] = None
        """Host memory exports land in where it has room (`take(nbytes)` -> (offset, uint8 tensor) or
        None): the engine process's exports segment (`page_segments.CorePages`); None: pinned buffers."""

    # ---- identity ----
    def hash_context(self, cache_salt: str = "") -> HashContext:
        return HashContext(self.model_id, self.layout.kv_dtype, self.layout.block_size, cache_salt)

    # ---- requests ----
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    cache_salt: str = "", export_kv: bool = False, hand_off: bool = False,
                    resume: Optional[ResumeState] = None,
                    output_kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        """Queues a request; `step` reports its progress as `output_kind` says (a stream: DELTA; the
        caller of a resume already has its tokens, so DELTA outputs start after them)."""
        params.validate()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        prompt = list(prompt_token_ids)
        bs = self.layout.block_size
        max_tokens = check_request(prompt, params, RequestLimits(
            self.model_config.vocab_size, self.max_model_len, self.config.scheduler.max_num_seqs, bs,
            self.kv.num_blocks), resume)
        ctx = self.hash_context(cache_salt)
        req = Request(request_id, prompt, params, max_tokens, bs, ctx.seed(), cache_salt=cache_salt,
                      export_kv=export_kv, hand_off=hand_off, resume=resume, output_kind=output_kind)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        seq = self._new_seq(req, 0)
        if resume is not None:
            req.forked = True
            seq.append_tokens(list(resume.output_token_ids))
            seq.detok.reset_from(prompt, resume.output_token_ids)
            if seq.logprobs is not None and resume.output_logprobs:
                seq.logprobs.extend(resume.output_logprobs)
            seq.resume_tail = (resume.tail_tokens, resume.tail)
            seq.sent_tokens, seq.sent_chars = seq.num_output_tokens, seq.detok.visible_len(False)
        req.seqs.append(seq)
        self._requests[request_id] = req
        self.scheduler.add(seq)

    def _new_seq(self, req: Request, index: int) -> Sequence:
        p = req.params
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed((p.seed + index * _SEED_MIX) % (1 << 63))
        detok = Detokenizer(self.tokenizer, req.prompt_token_ids, p.stop, p.include_stop_str_in_output,
                            p.skip_special_tokens)
        return Sequence(next(self._seq_ids), req, index, detok, gen)

    def _load_tail(self, seq: Sequence) -> None:
        _, tail = seq.resume_tail
        self.runner.write_slot(seq.residual_slot, tail)
        seq.resume_tail = None

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        req.forked = True
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        self._release_reserved(req)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    # ---- KV import / events ----
    def import_blocks(self, blocks: list[ExportedBlock], cache_salt: str = "",
                      rows: Optional[torch.Tensor] = None) -> int:
        """Puts pages computed elsewhere into the prefix cache (unreferenced, evictable). `rows`:
        the pages as host memory, uint8 [len(blocks), block_bytes] (page-locked on a GPU), copied
        straight from there (`KVCache.write_rows`: keep them until the stream passes the copy)."""
        for b in blocks:
            if len(b.token_ids) != self.layout.block_size:
                raise ValueError(f"blocks[].token_ids must hold {self.layout.block_size} tokens, "
                                 f"got {len(b.token_ids)}")
            if len(b.data) != self.layout.block_bytes:
                raise ValueError(f"blocks[].data is {len(b.data)} bytes, this engine's page is "
                                 f"{self.layout.block_bytes} (KV dtype {self.layout.kv_dtype})")
        if rows is not None and rows.shape[0] != len(blocks):
            raise ValueError(f"rows holds {rows.shape[0]} pages for {len(blocks)} blocks")
        ids, picks = [], []
        for i, b in enumerate(blocks):
            bid = self.kv.import_block(b.hash, b.token_ids)
            if bid is not None:  # None: already cached, or no free page (a resume recomputes it)
                ids.append(bid)
                picks.append(i)
        if rows is not None:  # one queued copy: the step in flight runs on
            self.runner.cache.write_rows(ids, rows, picks)
        else:
            self.runner.cache.write_pages(ids, [blocks[i].data for i in picks])
        return len(ids)

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        return self.kv.drain_events()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage, prefix_cache_queries=self.kv.queries,
            prefix_cache_hits=self.kv.hits, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens,
            num_blocks=self.kv.num_blocks, computed_tokens=self._computed_tokens,
            async_steps=self._async_steps)

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        """Schedules and computes one step. With async scheduling the step is launched and the step
        before it (launched by the last call) retired: the outputs are that step's, and a call that
        only launches returns none."""
        prev, self._inflight = self._inflight, None
        try:
            return self._step(prev)
        except BaseException:
            self._inflight = None  # the caller aborts what was running; nothing is read back
            raise

    def _step(self, prev: Optional[InFlightStep]) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.empty and prev is None:
            if self.scheduler.waiting and not self.scheduler.running:
                # add_request guarantees any one request fits an empty pool; this is a bug if hit
                raise RuntimeError(f"{len(self.scheduler.waiting)} waiting sequences cannot be scheduled "
                                   "on an idle engine")
            return []
        progressed: dict[str, Request] = {}
        plan = None if batch.empty else plan_step(batch)
        if plan is not None and self.async_scheduling and not plan.rows.prompt_rows:
            self._inflight = self._launch(batch, plan, prev)  # runs ahead of the host
            plan = None
        if prev is not None:
            self._retire(prev, progressed)
            if plan is not None:  # this step samples from what prev sampled: plan it with those tokens
                keep = [i for i, seq in enumerate(batch.seqs) if not seq.is_finished]
                batch = ScheduledBatch([batch.seqs[i] for i in keep], [batch.num_new[i] for i in keep])
                plan = None if batch.empty else plan_step(batch)
        if plan is not None:
            self._run(batch, plan, progressed)
        return [self._output(r) for r in progressed.values()
                if r.output_kind is not OutputKind.FINAL_ONLY or r.finished]

    def _run(self, batch: ScheduledBatch, plan: StepPlan, progressed: dict) -> None:
        """Computes and samples a step, reading its tokens back at once."""
        sample_logits, prompt_logits = self.runner.execute(plan.chunks, plan.slices, plan.rows)
        self._account(batch)
        for (r0, cnt, bi), logits in zip(plan.rows.prompt_rows, prompt_logits):
            self._add_prompt_logprobs(batch.seqs[bi], r0, cnt, logits)
        if plan.sample_seqs:
            self._sample(plan.sample_seqs, sample_logits, progressed)

    def _launch(self, batch: ScheduledBatch, plan: StepPlan, prev: Optional[InFlightStep]) -> Optional[InFlightStep]:
        """Computes and samples a step on the device and starts reading its tokens back. Everything a
        row's draw needs is known without the tokens in flight (penalties count those on the device)."""
        feed = prev.feed(plan.fed_rows, plan.fed_seqs, self.runner.device) if prev is not None else None
        if plan.fed_rows and feed is None:
            raise RuntimeError("a pending token without a step in flight")  # a bug if hit
        logits, _ = self.runner.execute(plan.chunks, plan.slices, plan.rows, feed)
        self._account(batch)
        self._async_steps += 1
        if not plan.sample_seqs:
            return None
        seqs, logits = self._with_forks(plan.sample_seqs, logits)
        rows = [self._sample_row(s, prev) for s in seqs]
        sample = self.sampler.sample_on_device(logits, rows)
        for seq in seqs:
            seq.pending += 1
            seq.stops_after_pending = (seq.num_output_tokens + seq.pending >= seq.request.max_tokens
                                       or seq.num_tokens >= self.max_model_len)
        return InFlightStep(seqs, rows, sample)

    def _retire(self, step: InFlightStep, progressed: dict) -> None:
        """Takes a launched step's tokens as a synchronous step would have (stops, outputs)."""
        for seq, tok, lp in zip(step.seqs, *step.results()):
            if seq.is_finished:
                continue  # aborted, or ended by the step before: its row here computed nothing kept
            seq.pending -= 1
            self._append(seq, tok, lp)
            if not seq.is_finished:
                self._cache_full_blocks(seq)  # blocks whose last token was pending
            progressed[seq.request.request_id] = seq.request

    def _account(self, batch: ScheduledBatch) -> None:
        """A computed step's counters, positions and newly full blocks."""
        self._computed_tokens += batch.num_tokens
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.num_computed_tokens < seq.num_prompt_tokens <= seq.num_computed_tokens + n \
                    and seq.num_preemptions == 0 and seq.index == 0:
                self._prompt_tokens += seq.num_prompt_tokens
            seq.num_computed_tokens += n
            self._cache_full_blocks(seq)

    def _add_prompt_logprobs(self, seq: Sequence, r0: int, cnt: int, logits: torch.Tensor) -> None:
        req = seq.request
        start = len(req.prompt_logprobs)  # next prompt token to score
        nxt = req.prompt_token_ids[start:start + cnt]
        req.prompt_logprobs.extend(prompt_logprobs(logits, nxt, req.params.prompt_logprobs))

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Registers computed blocks whose tokens are all known in the prefix cache."""
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.layout.block_size
        bs = self.layout.block_size
        for b in range(seq.num_cached_blocks, full):
            self.kv.cache_block(seq.block_ids[b], seq.block_hashes[b], seq.token_ids[b * bs:(b + 1) * bs])
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Splits an n > 1 request after its prompt: children share the prompt's pages and get a
        copy of the residual tail in their own reserved slots."""
        req = parent.request
        kids = []
        for i in range(1, req.params.n):
            kid = self._new_seq(req, i)
            kid.num_computed_tokens = parent.num_computed_tokens
            kid.block_ids = self.kv.fork(parent.block_ids)
            kid.num_cached_blocks = parent.num_cached_blocks
            slot = req.reserved_slots.pop()
            self.runner.copy_slot(parent.residual_slot, slot)
            self.scheduler.add_running(kid, slot)
            req.seqs.append(kid)
            kids.append(kid)
        req.forked = True
        return kids

    def _with_forks(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """Forks requests whose prompt this step completes into their n completions: (every sequence
        that samples, their logits rows [N', V], a child sampling from its parent's row)."""
        row_of: list[int] = []
        all_seqs: list[Sequence] = []
        for i, seq in enumerate(seqs):
            all_seqs.append(seq)
            row_of.append(i)
            if not seq.request.forked and seq.request.params.n > 1:
                for kid in self._fork(seq):
                    all_seqs.append(kid)
                    row_of.append(i)
        if len(all_seqs) != len(seqs):
            logits = logits[to_device(row_of, logits.device)]
        return all_seqs, logits

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, progressed: dict) -> None:
        all_seqs, logits = self._with_forks(seqs, logits)
        rows = [self._sample_row(s) for s in all_seqs]
        res = self.sampler(logits, rows)
        for seq, tok, lp in zip(all_seqs, res.token_ids, res.logprobs):
            self._append(seq, tok, lp)
            progressed[seq.request.request_id] = seq.request

    def _sample_row(self, seq: Sequence, prev: Optional[InFlightStep] = None) -> SampleRow:
        """prev: the step in flight, whose token for seq (if pending) penalties count on the device."""
        p = seq.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens + seq.pending < p.min_tokens:  # the index of the token it samples
            banned = tuple(p.stop_token_ids or ()) + (() if p.ignore_eos else tuple(self._eos))
        pending = prev.token_of(seq) if seq.pending and prev is not None and p.needs_penalties else None
        return SampleRow(p, seq.token_ids, seq.num_prompt_tokens, seq.generator, banned, seq.pending, pending,
                         seq.device_tensors)

    def _append(self, seq: Sequence, tok: int, lp: Optional[TokenLogprob]) -> None:
        seq.append_tokens([tok])
        self._generation_tokens += 1
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(lp)
        p = seq.params
        n_out = seq.num_output_tokens
        reason, stop_reason = None, None
        if n_out > p.min_tokens - 1 and not p.ignore_eos and tok in self._eos:
            reason = "stop"
        elif n_out > p.min_tokens - 1 and p.stop_token_ids and tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        else:
            hit = seq.detok.add_token(tok)
            if hit is not None and n_out >= p.min_tokens:
                reason, stop_reason = "stop", hit
            elif n_out >= seq.request.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
        if reason is not None:
            # Emit bytes held back as an incomplete character, unless the run only hands the
            # sequence on (a prefill hop at its one token): the next engine's tokens complete it.
            handing_on = seq.request.hand_off and reason == "length"
            if not isinstance(stop_reason, str) and not handing_on:
                seq.detok.flush()
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.pending, seq.stops_after_pending = 0, False  # a row of it in flight is dropped
        req = seq.request
        if req.export_kv and seq.index == 0:
            req.kv_export = self._export(seq)
        self.scheduler.finish(seq)
        if req.finished:
            self._release_reserved(req)
            self._requests.pop(req.request_id, None)

    def _release_reserved(self, req: Request) -> None:
        if req.reserved_slots:
            self.scheduler.return_slots(req.reserved_slots)
            req.reserved_slots = []

    def _export(self, seq: Sequence) -> KVExport:
        bs = self.layout.block_size
        full = seq.num_computed_tokens // bs
        cache, space = self.runner.cache, self.export_space
        sizes = (full * self.layout.block_bytes, cache.slot_bytes)  # the pages, then the tail
        taken = space.take(sum(sizes)) if space is not None and full else None
        copy = cache.copy_out(seq.block_ids[:full], seq.residual_slot,  # no wait for the device
                              into=taken[1] if taken else None)
        export = KVExport(seq.block_hashes[:full], [seq.token_ids[b * bs:(b + 1) * bs] for b in range(full)],
                          seq.num_computed_tokens % bs, self.runner.dtype_name, copy)
        if taken:
            export.shared_range = (taken[0], *sizes)
        return export

    def _output(self, req: Request) -> RequestOutput:
        finished = req.finished  # a scan of the request's sequences: once (every request, every step)
        delta = req.output_kind is OutputKind.DELTA
        prompt_lps = req.prompt_logprobs
        if delta and prompt_lps is not None:  # complete by the first sample: sent with it, once
            if req.prompt_logprobs_sent:
                prompt_lps = None
            req.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            outputs=[s.completion(delta) for s in req.seqs], finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=list(prompt_lps) if prompt_lps is not None else None,
            kv_export=req.kv_export if finished else None)
