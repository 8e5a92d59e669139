"""The decode worker: pulls a request's blocks by handle, generates, streams tokens back.

One Generate call:
 1. pulls the prompt's blocks (the prefill reply's handles, or with do_prefill the gateway's cached
    prefix) from the kvstore into the local pool as raw pages (no re-quantization), leased in flight;
 2. resumes from the prefill reply (first token + full-precision tail) or prefills itself;
 3. streams GenerateChunk deltas of what the caller has not seen: when resuming, the prefill
    reply already delivered the first token (and the prompt logprobs), so the stream starts after it;
    with do_prefill it carries everything, the prompt logprobs in the first chunk;
 4. on finish, puts the newly filled full blocks (prompt tail + generated text) to the kvstore and
    publishes, so the next turn of the conversation hits on any worker. The put runs to completion
    even when the caller stops reading after the last chunk.
A cancelled stream closes the engine iterator, which aborts the request and frees its blocks at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional

import grpc
from opentelemetry import trace

from kvmesh.block_transfer import BlockTransfer
from kvmesh.decode.config import DecodeConfig
from kvmesh.engine.outputs import OutputKind
from kvmesh.kv.layout import BlockLayout
from kvmesh.telemetry import Metrics, server_span
from kvmesh.wire import convert
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc
from kvmesh.worker_runtime import Worker, WorkerRuntime, serve_worker

log = logging.getLogger(__name__)


_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _check_prefilled(request: pb.GenerateRequest, layout: BlockLayout, dtype_name: str) -> None:
    """The prefill reply must describe exactly this prompt, in this engine's shapes (checked here:
    inside the engine step a bad tail would fail every request in the batch). ValueError names the field."""
    p = request.prefilled
    n, bs = len(request.prompt_token_ids), layout.block_size
    if len(p.blocks) != n // bs:
        raise ValueError(f"prefilled.blocks has {len(p.blocks)} blocks; a {n}-token prompt has "
                         f"{n // bs} full blocks of {bs}")
    if p.tail.num_tokens != n % bs:
        raise ValueError(f"prefilled.tail.num_tokens is {p.tail.num_tokens}, expected {n % bs}")
    if p.tail.dtype != dtype_name:
        raise ValueError(f"prefilled.tail.dtype is {p.tail.dtype!r} but this decode worker runs {dtype_name!r} "
                         "(give prefill and decode workers the same --dtype)")
    want = layout.num_layers * 2 * layout.kv_heads * bs * layout.head_dim * _ELEMENT_BYTES[dtype_name]
    if len(p.tail.data) != want:
        raise ValueError(f"prefilled.tail.data is {len(p.tail.data)} bytes, expected {want} "
                         "(layers x 2 x kv_heads x block_size x head_dim; same --model on both workers?)")


class DecodeServicer(pb_grpc.DecodeServicer):
    def __init__(self, runtime: WorkerRuntime, transfer: BlockTransfer, tracer: trace.Tracer,
                 max_chunk_rate: int = 0) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.transfer = transfer
        self.tracer = tracer
        self.metrics = runtime.metrics
        self._ids = itertools.count()
        self.max_chunk_rate = max_chunk_rate
        self.streaming = 0  # streams past their first message, which --max-chunk-rate shares out

    def _pace(self) -> float:
        """Seconds a stream waits between messages: --max-chunk-rate shared by the active streams."""
        return self.streaming / self.max_chunk_rate

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReply:
        return self.runtime.load_reply()

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        async with self.runtime.admitted(context):
            # aclosing: a cancelled call closes the inner generator, which closes the engine stream.
            async with contextlib.aclosing(self._generate(request, context)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _generate(self, request: pb.GenerateRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        with server_span(self.tracer, "kvmesh.decode/Generate", context) as span:
            start = time.perf_counter()
            prompt = list(request.prompt_token_ids)
            # Engine ids are unique per call: a retried request may arrive while its old run aborts.
            rid = f"{request.request_id or 'decode'}#{next(self._ids)}"
            span.set_attribute("kvmesh.request_id", rid)
            span.set_attribute("kvmesh.prompt_tokens", len(prompt))
            resuming = not request.do_prefill
            try:
                params = convert.sampling_from_proto(request.sampling)
                if resuming:
                    if not request.HasField("prefilled"):
                        raise ValueError("prefilled: required unless do_prefill is set")
                    _check_prefilled(request, self.transfer.layout, self.engine.info.dtype_name)
                    refs = convert.block_refs_from_proto(request.prefilled.blocks)
                else:
                    refs = convert.block_refs_from_proto(request.cached_blocks)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            span.set_attribute("kvmesh.do_prefill", not resuming)

            if resuming and request.prefilled.finish_reason:
                # The first token already ended the request: nothing left to generate.
                yield self._finished_at_first(request)
                return

            local = self.runtime.known_blocks()
            if resuming:  # a block the prefill worker could not store ends what is worth asking for
                refs = list(itertools.takewhile(lambda r: r.node or r.hash in local, refs))
            pulled = await self.transfer.pull(self.engine, [r.hash for r in refs], request.cache_salt,
                                              local=local)
            span.set_attribute("kvmesh.pulled_blocks", len(pulled.imported))
            span.set_attribute("kvmesh.missing_blocks", pulled.missing)
            resume = convert.resume_from_prefill(request.prefilled, params.logprobs is not None) if resuming else None

            # What the caller already has: the prefill reply's first token when resuming (the
            # engine's DELTA outputs start after it).
            sent_tokens = len(resume.output_token_ids) if resuming else 0
            last_token_at = None
            final = None
            try:
                async with contextlib.aclosing(self.engine.generate(
                        rid, prompt, params, cache_salt=request.cache_salt, export_kv=True,
                        resume=resume, output_kind=OutputKind.DELTA,
                        pace=self._pace if self.max_chunk_rate else None)) as stream:
                    async for out in stream:
                        final = out
                        if getattr(out, "error", None):
                            await context.abort(grpc.StatusCode.INTERNAL, f"request {rid} failed: {out.error}")
                        comp = out.outputs[0]
                        new_ids = comp.token_ids
                        if not new_ids and not comp.finish_reason:
                            continue
                        now = time.perf_counter()
                        if last_token_at is None:
                            self.streaming += 1
                            if not resuming:
                                self.metrics.time_to_first_token_seconds.observe(now - start)
                        elif new_ids:
                            self.metrics.inter_token_latency_seconds.observe((now - last_token_at) / len(new_ids))
                        last_token_at = now
                        chunk = pb.GenerateChunk(
                            token_ids=new_ids, text=comp.text,
                            logprobs=convert.logprobs_to_proto(comp.logprobs or []),
                            finish_reason=comp.finish_reason or "",
                            num_prompt_tokens=len(prompt),
                            num_cached_tokens=self._cached_tokens(request, out))
                        if sent_tokens == 0:
                            chunk.prompt_logprobs.extend(convert.prompt_logprobs_to_proto(out.prompt_logprobs))
                        sent_tokens += len(new_ids)
                        yield chunk
            except ValueError as e:  # bad prompt/params for this engine (e.g. too long for --max-model-len)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RuntimeError as e:  # the engine failed the step or is stopping
                await context.abort(grpc.StatusCode.INTERNAL, f"request {rid} failed: {e}")
            finally:
                if last_token_at is not None:
                    self.streaming -= 1
            self.metrics.e2e_request_latency_seconds.observe(time.perf_counter() - start)
            span.set_attribute("kvmesh.generated_tokens", sent_tokens)
            if final is not None and final.kv_export is not None:
                known = set(pulled.imported)  # the rest: asked with Contains (refs may have been stale)
                # Its own task, not awaited: the stream ends now, and a caller that hangs up after
                # the last chunk does not cancel it (a hung kvstore held every stream's end 5 s).
                self.runtime.spawn(self._push(final.kv_export, known))

    async def _push(self, export: Any, known: set[bytes]) -> None:
        try:
            await asyncio.to_thread(export.ready)  # the pages' copy from the device lands off the loop
            await self.transfer.push(export.blocks, known=known)  # the publish tick announces them
        except Exception:  # advisory: the next turn recomputes what did not land
            log.exception("decode: putting finished blocks to the kvstore failed")
        finally:
            export.release()

    @staticmethod
    def _cached_tokens(request: pb.GenerateRequest, out: Any) -> int:
        # When resuming, what the user was served from cache is what the prefill worker found.
        return request.prefilled.num_cached_tokens if not request.do_prefill else out.num_cached_tokens

    @staticmethod
    def _finished_at_first(request: pb.GenerateRequest) -> pb.GenerateChunk:
        p = request.prefilled
        return pb.GenerateChunk(finish_reason=p.finish_reason, num_prompt_tokens=len(request.prompt_token_ids),
                                num_cached_tokens=p.num_cached_tokens)


class DecodeWorker(Worker):
    """A decode worker with its dependencies passed in (serve() builds the real ones)."""

    role = "decode"

    def __init__(self, cfg: DecodeConfig, engine: Any, kvstore: Any, index: Any,
                 metrics: Optional[Metrics] = None, tracer: Optional[trace.Tracer] = None) -> None:
        super().__init__(cfg, engine, kvstore, index, metrics)
        self.servicer = DecodeServicer(self.runtime, self.transfer,
                                        tracer or trace.get_tracer("kvmesh.decode"), cfg.max_chunk_rate)
        self.runtime.add_servicer(lambda s: pb_grpc.add_DecodeServicer_to_server(self.servicer, s))


async def serve(cfg: DecodeConfig, on_ready: Callable[[], None] = lambda: None) -> None:
    """Runs a decode worker until cancelled (kvmesh decode ...); `on_ready()` once it serves."""
    await serve_worker(cfg, DecodeWorker, on_ready)
