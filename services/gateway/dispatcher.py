"""One request's trip through the workers: index lookup, route, prefill hop or not, token stream back.

`Dispatcher.run` yields `Delta`s of all n choices merged, in arrival order. Closing the iterator (a
client that went away) cancels every gRPC call still open, which makes the decode worker abort the
request and free its blocks. A worker that is unreachable before it produced anything is marked
down and the choice is routed again; capacity errors become 429, bad input 400. A worker the health
checks find down (dead, or hung: a stopped process answers nothing, not even an error) has its
calls cancelled (`worker_down`): before, a request sent to a stopped prefill worker waited 80 s for
the channel's keepalive to give up. A choice whose decode worker dies or hangs after it sent tokens
goes on on another decode worker where that is exact (`resumption.py`); where it is not, its stream
is failed once it has sent nothing for `--stalled-stream-timeout` while its worker is down
(`give_up_stalled`), where it waited for the keepalive (~80 s) before.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator, Callable, Optional, Sequence

import grpc

from kvmesh.gateway.metrics import GatewayMetrics
from kvmesh.gateway.openai_api import ApiError, Sampling
from kvmesh.gateway.resumption import Sent, resumable, resumed_sampling
from kvmesh.gateway.router import NoWorkerError, RouteDecision, Router
from kvmesh.gateway.worker_client import WorkerClients
from kvmesh.wire import kvmesh_pb2 as pb


@dataclass
class Delta:
    """New output of one choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # pb.TokenLogprob per token, when asked
    finish_reason: Optional[str] = None
    num_prompt_tokens: Optional[int] = None  # set once per choice, on its first delta
    num_cached_tokens: Optional[int] = None
    prompt_logprobs: Optional[list] = None  # pb.TokenLogprob per prompt token (first may be absent)


_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "timeout"),
}


def api_error_from_grpc(e: grpc.aio.AioRpcError, address: str) -> ApiError:
    status, kind = _GRPC_TO_HTTP.get(e.code(), (500, "internal_error"))
    return ApiError(status, f"worker {address}: {e.details() or e.code().name}", type=kind)


def sampling_pb(s: Sampling, *, seed: Optional[int], max_tokens: int) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, max_tokens=max_tokens,
        min_tokens=s.min_tokens, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
        include_stop_str_in_output=s.include_stop_str_in_output)
    if seed is not None:
        msg.seed = seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    if s.logit_bias:
        msg.logit_bias.update(dict(s.logit_bias))
    return msg


class _Waiting:
    """A call to a worker in flight: `streamed` once a chunk of it came, `can_resume` whether its
    choice could go on elsewhere from what it sent (a stream that sent tokens is only given up then)."""

    def __init__(self, call, can_resume: Optional[Callable[[], bool]]) -> None:
        self.call = call
        self.can_resume = can_resume
        self.streamed = False
        self.abandoned = False
        self.last_chunk = time.monotonic()  # when the call began or last sent a chunk

    def worth_abandoning(self) -> bool:
        return not self.streamed or (self.can_resume is not None and self.can_resume())


def _cancelled_by_us() -> bool:
    """Whether this task itself is being cancelled (the client left), not only a call of it."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())


class Dispatcher:
    def __init__(self, router: Router, clients: WorkerClients, metrics: GatewayMetrics, *,
                 timeout_s: float, detokenize: Optional[Callable[[list[int]], str]] = None) -> None:
        self.router = router
        self.clients = clients
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.detokenize = detokenize  # token ids -> text as the workers stream it (resumption.py)
        self._waiting: dict[str, set[_Waiting]] = {}  # worker -> its calls in flight

    def worker_down(self, address: str) -> int:
        """The health checks found `address` down: cancel its calls in flight (their choices are
        routed again, or resumed elsewhere where they had sent tokens). How many."""
        return self._abandon(address, lambda w: w.worth_abandoning())  # the rest may yet go on

    def give_up_stalled(self, address: str, silent_s: float) -> int:
        """`address` is still down: cancel its streams that cannot go on elsewhere and have sent
        nothing for `silent_s` (their clients get the error in-band); a worker the checks only
        misjudge keeps streaming, and its streams live. How many."""
        now = time.monotonic()
        return self._abandon(address, lambda w: now - w.last_chunk >= silent_s)

    def _abandon(self, address: str, which: Callable[[_Waiting], bool]) -> int:
        waiting = self._waiting.get(address, set())
        given_up = [w for w in waiting if which(w)]
        for w in given_up:
            waiting.discard(w)
            w.abandoned = True
            w.call.cancel()
        return len(given_up)

    @contextmanager
    def _watch(self, address: str, call, can_resume: Optional[Callable[[], bool]] = None):
        """While inside, `call` is cancelled if `address` goes down (_Waiting.worth_abandoning);
        _WorkerDown is raised then (mid-stream where the caller set `streamed`)."""
        w = _Waiting(call, can_resume)
        self._waiting.setdefault(address, set()).add(w)
        try:
            yield w
        except asyncio.CancelledError:
            if w.abandoned and not _cancelled_by_us():
                raise _WorkerDown(address, None, mid_stream=w.streamed) from None
            raise
        finally:
            self._waiting.get(address, set()).discard(w)

    async def run(self, request_id: str, prompt_ids: Sequence[int], hashes: Sequence[bytes],
                  holders: Sequence[frozenset[str]], sampling: Sampling, *, n: int, max_tokens: int,
                  cache_salt: str, index_base: int = 0) -> AsyncIterator[Delta]:
        """Merged deltas of n choices (indices index_base + 0..n-1); raises ApiError on failure."""
        its = [self._choice(index_base + i, f"{request_id}-{index_base + i}", prompt_ids, hashes,
                            holders, sampling, max_tokens, cache_salt) for i in range(n)]
        async with aclosing(merge(its)) as merged:
            async for d in merged:
                yield d

    async def _choice(self, index: int, request_id: str, prompt_ids: Sequence[int],
                      hashes: Sequence[bytes], holders: Sequence[frozenset[str]], s: Sampling,
                      max_tokens: int, cache_salt: str) -> AsyncIterator[Delta]:
        seed = None if s.seed is None else (s.seed + index) % 2**63  # distinct samples per choice
        params = sampling_pb(s, seed=seed, max_tokens=max_tokens)
        tried: set[str] = set()
        while True:
            try:
                decision = self.router.route(len(prompt_ids), hashes, holders)
            except NoWorkerError as e:
                raise ApiError(503, str(e), type="service_unavailable") from None
            self.metrics.decision(decision.reason, decision.predicted_hit_tokens)
            sent = Sent()
            can_resume = partial(resumable, params, sent, self.detokenize)
            try:
                async with aclosing(self._attempt(index, request_id, prompt_ids, decision, params,
                                                  cache_salt, can_resume)) as attempt:
                    async for d in attempt:
                        sent.add(d.token_ids, d.text)
                        yield d
                return
            except _WorkerDown as e:
                if sent.ids:  # tokens reached the client: go on elsewhere from there, if exact
                    async with aclosing(self._resume(index, request_id, prompt_ids, params, cache_salt,
                                                     sent, e)) as rest:
                        async for d in rest:
                            yield d
                    return
                # Nothing reached the client yet: route around the dead worker.
                if e.address in tried:
                    raise e.api_error() from None
                tried.add(e.address)
                self.router.mark(e.address, False)

    async def _resume(self, index: int, request_id: str, prompt_ids: Sequence[int], params: pb.SamplingParams,
                      cache_salt: str, sent: Sent, failed: "_WorkerDown") -> AsyncIterator[Delta]:
        """The rest of a choice on another decode worker, after `failed` (resumption.py)."""
        tried = {failed.address}
        can_resume = partial(resumable, params, sent, self.detokenize)
        while True:
            self.router.mark(failed.address, False)
            others = [a for a in self.router.healthy("decode") if a not in tried]
            if not others or not can_resume():
                raise failed.api_error()
            address = self.router.choose({a: float(self.router.workers[a].load) for a in others})
            tried.add(address)
            self.metrics.lab(self.metrics.resumed_choices).inc()
            req = pb.GenerateRequest(request_id=f"{request_id}+{len(sent.ids)}",
                                     prompt_token_ids=list(prompt_ids) + sent.ids, cache_salt=cache_salt,
                                     sampling=resumed_sampling(params, len(sent.ids)), do_prefill=True)
            try:
                async with aclosing(self._decode(address, req, index, None, can_resume)) as stream:
                    async for d in stream:
                        sent.add(d.token_ids, d.text)
                        yield d
                return
            except _WorkerDown as e:
                failed = e

    async def _attempt(self, index: int, request_id: str, prompt_ids: Sequence[int],
                       decision: RouteDecision, params: pb.SamplingParams, cache_salt: str,
                       can_resume: Optional[Callable[[], bool]] = None) -> AsyncIterator[Delta]:
        refs = [pb.BlockRef(hash=h, node=node) for h, node in decision.cached_blocks]
        predicted = decision.predicted_hit_tokens
        want_prompt_lps = params.HasField("prompt_logprobs")
        if decision.prefill is not None:
            self.metrics.lab(self.metrics.router_prefill_hops).inc()
            reply = await self._prefill(decision.prefill, pb.PrefillRequest(
                request_id=request_id, prompt_token_ids=list(prompt_ids), sampling=params,
                num_cached_blocks=decision.hit_blocks, cache_salt=cache_salt, cached_blocks=refs),
                queued=len(prompt_ids) - predicted)
            self.metrics.prompt_done(len(prompt_ids), reply.num_cached_tokens, predicted)
            # The first token comes from the prefill reply; the decode stream starts after it.
            yield Delta(index=index, text=reply.first_text, token_ids=[reply.first_token],
                        logprobs=[reply.first_logprob] if params.HasField("logprobs") else [],
                        finish_reason=reply.finish_reason or None, num_prompt_tokens=len(prompt_ids),
                        num_cached_tokens=reply.num_cached_tokens,
                        prompt_logprobs=list(reply.prompt_logprobs) if want_prompt_lps else None)
            if reply.finish_reason:
                return
            req = pb.GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt_ids),
                                     sampling=params, cache_salt=cache_salt, prefilled=reply)
            decode = decision.decode
            while True:  # a dead decode worker is replaced: the prefill reply can resume anywhere
                try:
                    async with aclosing(self._decode(decode, req, index, None, can_resume)) as stream:
                        async for d in stream:
                            yield d
                    return
                except _WorkerDown as e:
                    if e.mid_stream:
                        raise  # tokens reached the client: _choice resumes from them
                    self.router.mark(e.address, False)
                    others = self.router.healthy("decode")
                    if not others:
                        raise e.api_error() from None
                    decode = self.router.choose({a: float(self.router.workers[a].load) for a in others})
        req = pb.GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt_ids),
                                 sampling=params, cache_salt=cache_salt, do_prefill=True,
                                 cached_blocks=refs)
        async with aclosing(self._decode(decision.decode, req, index, predicted, can_resume)) as stream:
            async for d in stream:
                yield d

    async def _decode(self, address: str, req: pb.GenerateRequest, index: int,
                      predicted: Optional[int], can_resume: Optional[Callable[[], bool]] = None
                      ) -> AsyncIterator[Delta]:
        """Forward one Generate stream. `predicted` set: this call prefills, its first chunk
        reports the prompt (tokens, cached tokens, prompt logprobs). `can_resume`: whether the
        choice could go on elsewhere (a hung worker's stream is given up only then)."""
        queued = 0 if predicted is None else max(0, len(req.prompt_token_ids) - predicted)
        self.router.begin(address, queued)
        call = self.clients[address].generate(req, timeout=self.timeout_s)
        with self._watch(address, call, can_resume) as w:
            try:
                async for chunk in call:
                    if not w.streamed:
                        self.router.prefilled(address, queued)
                        queued = 0
                    d = Delta(index=index, text=chunk.text, token_ids=list(chunk.token_ids),
                              logprobs=list(chunk.logprobs), finish_reason=chunk.finish_reason or None)
                    if not w.streamed and predicted is not None:
                        n = len(req.prompt_token_ids)
                        d.num_prompt_tokens = chunk.num_prompt_tokens or n
                        d.num_cached_tokens = chunk.num_cached_tokens
                        if req.sampling.HasField("prompt_logprobs"):
                            d.prompt_logprobs = list(chunk.prompt_logprobs)
                        self.metrics.prompt_done(n, chunk.num_cached_tokens, predicted)
                    w.streamed = True
                    w.last_chunk = time.monotonic()
                    yield d
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    raise _WorkerDown(address, e, mid_stream=w.streamed) from None
                raise api_error_from_grpc(e, address) from None
            finally:
                call.cancel()  # no-op when finished; aborts the request on the worker otherwise
                self.router.end(address, queued)

    async def _prefill(self, address: str, req: pb.PrefillRequest, queued: int) -> pb.PrefillReply:
        self.router.begin(address, queued)
        start = time.perf_counter()
        call = self.clients[address].prefill(req, timeout=self.timeout_s)
        try:
            with self._watch(address, call):
                reply = await call
            self.metrics.lab(self.metrics.prefill_call).observe(time.perf_counter() - start)
            return reply
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise _WorkerDown(address, e) from None
            raise api_error_from_grpc(e, address) from None
        finally:
            self.router.end(address, queued)


class _WorkerDown(Exception):
    def __init__(self, address: str, error: Optional[grpc.aio.AioRpcError], mid_stream: bool = False) -> None:
        super().__init__(address)
        self.address = address
        self.error = error  # None: the health checks found it down while the call waited
        self.mid_stream = mid_stream  # the stream had sent chunks

    def api_error(self) -> ApiError:
        if self.error is not None:
            return api_error_from_grpc(self.error, self.address)
        return ApiError(503, f"worker {self.address} stopped answering health checks", type="service_unavailable")


async def merge(its: list) -> AsyncIterator:
    """Items of several async iterators in arrival order; the first failure (or our own closing)
    cancels the rest, which closes their gRPC calls."""
    if len(its) == 1:
        try:
            async for x in its[0]:
                yield x
        finally:
            await its[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done_marker = object()

    async def pump(it) -> None:
        try:
            async with aclosing(it):
                async for x in it:
                    await queue.put(x)
            await queue.put(done_marker)
        except Exception as e:  # handed to the reader, who re-raises it
            await queue.put(e)

    tasks = [asyncio.create_task(pump(it)) for it in its]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is done_marker:
                done += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
