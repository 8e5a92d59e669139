"""LLMEngine: requests in, one scheduled and computed step at a time, RequestOutputs out.

Single-threaded by design (AsyncEngine runs it in one background thread). Per step: the scheduler
picks sequences and token counts, the runner computes them, new full blocks enter the prefix cache,
the sampler picks tokens, stop conditions are checked and finished sequences free their pages.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch

from kvmesh.config import EngineConfig
from kvmesh.engine.detokenizer import Detokenizer
from kvmesh.engine.outputs import ExportedBlock, KVExport, OutputKind, RequestOutput, ResumeState, TokenLogprob
from kvmesh.engine.runner import ModelRunner, StepRows
from kvmesh.engine.sampler import SampleRow, Sampler, prompt_logprobs
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import ScheduledBatch, Scheduler, SchedulerLimits
from kvmesh.engine.sequence import Request, Sequence
from kvmesh.engine.stats import EngineStats
from kvmesh.hashing import HashContext
from kvmesh.kernels.metadata import SeqSlice
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
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        V = self.model_config.vocab_size
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token {bad!r} is outside the vocabulary [0, {V})")
        bad = next((t for t in params.logit_bias or () if t >= V), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token {bad} is outside the vocabulary [0, {V})")
        P, M = len(prompt), self.max_model_len
        if P >= M:
            raise ValueError(f"prompt_token_ids: the prompt has {P} tokens; --max-model-len {M} leaves "
                             "no room for output")
        max_tokens = params.max_tokens if params.max_tokens is not None else M - P
        if P + max_tokens > M:
            raise ValueError(f"max_tokens: prompt ({P}) + max_tokens ({max_tokens}) exceeds "
                             f"--max-model-len {M}")
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds --max-num-seqs {self.config.scheduler.max_num_seqs}")
        bs = self.layout.block_size
        need = (P + max_tokens) // bs
        if need > self.kv.num_blocks:
            raise ValueError(f"max_tokens: prompt + max_tokens needs {need} KV blocks but the pool holds "
                             f"{self.kv.num_blocks}; increase --kv-cache-memory or lower max_tokens")
        if resume is not None:
            if params.n != 1:
                raise ValueError("n must be 1 for a resumed request")
            if not resume.output_token_ids:
                raise ValueError("resume.output_token_ids must hold at least the first token")
            if resume.tail_tokens != P % bs:
                raise ValueError(f"resume.tail_tokens must be {P % bs} for a {P}-token prompt at block "
                                 f"size {bs}, got {resume.tail_tokens}")
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
    def import_blocks(self, blocks: list[ExportedBlock], cache_salt: str = "") -> int:
        """Puts pages computed elsewhere into the prefix cache (unreferenced, evictable)."""
        new = 0
        for b in blocks:
            if len(b.token_ids) != self.layout.block_size:
                raise ValueError(f"blocks[].token_ids must hold {self.layout.block_size} tokens, "
                                 f"got {len(b.token_ids)}")
            if len(b.data) != self.layout.block_bytes:
                raise ValueError(f"blocks[].data is {len(b.data)} bytes, this engine's page is "
                                 f"{self.layout.block_bytes} (KV dtype {self.layout.kv_dtype})")
            bid = self.kv.import_block(b.hash, b.token_ids)
            if bid is None:
                continue  # already cached, or no free page: a resume recomputes what is missing
            self.runner.write_page(bid, b.data)
            new += 1
        return new

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        return self.kv.drain_events()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage, prefix_cache_queries=self.kv.queries,
            prefix_cache_hits=self.kv.hits, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens,
            num_blocks=self.kv.num_blocks, computed_tokens=self._computed_tokens)

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.empty:
            if self.scheduler.waiting and not self.scheduler.running:
                # add_request guarantees any one request fits an empty pool; this is a bug if hit
                raise RuntimeError(f"{len(self.scheduler.waiting)} waiting sequences cannot be scheduled "
                                   "on an idle engine")
            return []
        sample_seqs, rows, chunks, slices = self._plan(batch)
        sample_logits, prompt_logits = self.runner.execute(chunks, slices, rows)
        self._computed_tokens += batch.num_tokens
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.num_computed_tokens < seq.num_prompt_tokens <= seq.num_computed_tokens + n \
                    and seq.num_preemptions == 0 and seq.index == 0:
                self._prompt_tokens += seq.num_prompt_tokens
            seq.num_computed_tokens += n
            self._cache_full_blocks(seq)
        for (r0, cnt, bi), logits in zip(rows.prompt_rows, prompt_logits):
            self._add_prompt_logprobs(batch.seqs[bi], r0, cnt, logits)
        progressed: dict[str, Request] = {}
        if sample_seqs:
            self._sample(sample_seqs, sample_logits, progressed)
        return [self._output(r) for r in progressed.values()
                if r.output_kind is not OutputKind.FINAL_ONLY or r.finished]

    def _plan(self, batch: ScheduledBatch):
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[int, int, int]] = []
        chunks: list[list[int]] = []
        slices: list[SeqSlice] = []
        row = 0
        for bi, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
            c = seq.num_computed_tokens
            chunks.append(seq.token_ids[c:c + n])
            slices.append(SeqSlice(c, n, seq.block_ids, seq.residual_slot))
            req = seq.request
            if req.prompt_logprobs is not None and seq.index == 0:
                lo = max(c, len(req.prompt_logprobs) - 1)
                hi = min(c + n, seq.num_prompt_tokens - 1)
                if hi > lo:  # positions lo..hi-1 predict prompt tokens lo+1..hi
                    prompt_rows.append((row + lo - c, hi - lo, bi))
            if c + n == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(row + n - 1)
            row += n
        return sample_seqs, StepRows(sample_rows, prompt_rows), chunks, slices

    def _add_prompt_logprobs(self, seq: Sequence, r0: int, cnt: int, logits: torch.Tensor) -> None:
        req = seq.request
        start = len(req.prompt_logprobs)  # next prompt token to score
        nxt = req.prompt_token_ids[start:start + cnt]
        req.prompt_logprobs.extend(prompt_logprobs(logits, nxt, req.params.prompt_logprobs))

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Registers blocks completed by this step in the prefix cache."""
        full = seq.num_computed_tokens // self.layout.block_size
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

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, progressed: dict) -> None:
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
            logits = logits[row_of]
        rows = [self._sample_row(s) for s in all_seqs]
        res = self.sampler(logits, rows)
        for seq, tok, lp in zip(all_seqs, res.token_ids, res.logprobs):
            self._append(seq, tok, lp)
            progressed[seq.request.request_id] = seq.request

    def _sample_row(self, seq: Sequence) -> SampleRow:
        p = seq.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            banned = tuple(p.stop_token_ids or ()) + (() if p.ignore_eos else tuple(self._eos))
        return SampleRow(p, seq.token_ids, seq.num_prompt_tokens, seq.generator, banned)

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
            elif n_out >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
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
        blocks = [ExportedBlock(seq.block_hashes[b], seq.token_ids[b * bs:(b + 1) * bs],
                                self.runner.read_page(seq.block_ids[b])) for b in range(full)]
        return KVExport(blocks, seq.num_computed_tokens % bs, self.runner.read_slot(seq.residual_slot),
                        self.runner.dtype_name)

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
