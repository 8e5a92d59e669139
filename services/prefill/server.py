"""The prefill worker: computes a prompt's KV and hands the first token and the block handles on.

One Prefill call:
 1. pulls the cached prefix blocks the gateway named (those not already in the local prefix cache)
    from the kvstore into the engine, leased while in flight;
 2. runs the prompt with max_tokens=1 and export_kv=True (the engine batches concurrent prefills by
    continuous batching, in chunks); a block that vanished on the way is simply recomputed;
 3. puts the full blocks the kvstore lacks, so the decode worker can pull them;
 4. replies with the first token, every prompt block's handle (node = its rendezvous owner) and the
    partial last block in full precision.
Local prefix-cache events are published to the index under this worker's address by the runtime's
publish tick (every --publish-interval), never on a request's path: a drain waits for the engine's
step boundary, so one drain a reply left a burst's replies one engine step apart.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from typing import Any, Callable, Optional

import grpc
from opentelemetry import trace

from kvmesh.block_transfer import BlockTransfer
from kvmesh.kvstore.client import node_for
from kvmesh.prefill.config import PrefillConfig
from kvmesh.telemetry import Metrics, server_span
from kvmesh.wire import convert
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc
from kvmesh.worker_runtime import Worker, WorkerRuntime, serve_worker

log = logging.getLogger(__name__)


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, runtime: WorkerRuntime, transfer: BlockTransfer, nodes: list[str],
                 tracer: trace.Tracer) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.transfer = transfer
        self.nodes = nodes
        self.tracer = tracer
        self.metrics = runtime.metrics
        self._ids = itertools.count()

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReply:
        return self.runtime.load_reply()

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillReply:
        async with self.runtime.admitted(context):
            return await self._prefill(request, context)

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillReply:
        with server_span(self.tracer, "kvmesh.prefill/Prefill", context) as span:
            start = time.perf_counter()
            prompt = list(request.prompt_token_ids)
            # Engine ids are unique per call: a retried request may arrive while its old run aborts.
            rid = f"{request.request_id or 'prefill'}#{next(self._ids)}"
            span.set_attribute("kvmesh.request_id", rid)
            span.set_attribute("kvmesh.prompt_tokens", len(prompt))
            try:
                params = convert.sampling_from_proto(request.sampling)
                refs = convert.block_refs_from_proto(request.cached_blocks)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            span.set_attribute("kvmesh.cached_blocks", len(refs))

            pulled = await self.transfer.pull(self.engine, [r.hash for r in refs], request.cache_salt,
                                              local=self.runtime.known_blocks())
            span.set_attribute("kvmesh.pulled_blocks", len(pulled.imported))
            span.set_attribute("kvmesh.missing_blocks", pulled.missing)

            # Only the first token is sampled here; min_tokens > 1 is the decode worker's business.
            first_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
            final = None
            try:
                # a hand-off unless the caller asked for one token: the decode worker goes on
                async with contextlib.aclosing(self.engine.generate(
                        rid, prompt, first_params, cache_salt=request.cache_salt, export_kv=True,
                        hand_off=params.max_tokens != 1)) as stream:
                    async for out in stream:
                        final = out
            except ValueError as e:  # bad prompt (empty, too long for --max-model-len, ...)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RuntimeError as e:  # the engine failed the step or is stopping
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill of {rid} failed: {e}")
            if final is None or getattr(final, "error", None) or final.kv_export is None:
                why = getattr(final, "error", None) or "engine returned no KV export"
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill of {rid} failed: {why}")
            ttft = time.perf_counter() - start
            self.metrics.time_to_first_token_seconds.observe(ttft)

            export = final.kv_export
            waited = time.perf_counter()
            await asyncio.to_thread(export.ready)  # the pages' copy from the device lands off the loop
            if self.transfer.metrics:
                self.transfer.metrics.exported(time.perf_counter() - waited,
                                               shared=bool(export.blocks) and export.blocks[0].shared is not None)
            known = set(pulled.imported)  # the rest: asked with Contains (refs may have been stale)
            # The decode worker pulls these next: they must be in the store before the reply.
            try:
                pushed = await self.transfer.push(export.blocks, known=known)
            finally:
                export.release()  # the pages' shared range, if they came through one
            span.set_attribute("kvmesh.pushed_blocks", pushed.stored)
            # A failed put stored none of what the store lacked: the decode worker must not wait on
            # a dead node for those, so their refs name no node (it recomputes from the first).
            unstored = {b.hash for b in export.blocks} - known if pushed.error else set()

            # Handles name the node the put went to: the rendezvous owner among the live nodes.
            live = self.transfer.kvstore.live_nodes() if hasattr(self.transfer.kvstore, "live_nodes") else []
            nodes = live or self.nodes
            comp = final.outputs[0]
            finish = ""
            if comp.finish_reason == "stop" or (comp.finish_reason and params.max_tokens == 1):
                finish = comp.finish_reason
            reply = pb.PrefillReply(
                first_token=comp.token_ids[0], first_text=_visible_text(comp.text, params.stop, bool(finish)),
                blocks=convert.block_refs_to_proto(
                    convert.BlockRef(b.hash, "" if b.hash in unstored else node_for(b.hash, nodes))
                    for b in export.blocks),
                tail=convert.tail_to_proto(convert.tail_from_export(export)),
                num_cached_tokens=final.num_cached_tokens,
                prompt_logprobs=convert.prompt_logprobs_to_proto(final.prompt_logprobs),
                finish_reason=finish)
            if comp.logprobs:
                reply.first_logprob.CopyFrom(convert.logprob_to_proto(comp.logprobs[0]))
            span.set_attribute("kvmesh.cached_tokens", final.num_cached_tokens)
            if finish:
                self.metrics.e2e_request_latency_seconds.observe(time.perf_counter() - start)
            return reply


def _visible_text(text: str, stop: Optional[list[str]], finished: bool) -> str:
    """The first token's text the caller may show. While the request goes on, hold back what could
    start a stop string (as the engine does), or the decode stream could not take it back."""
    hold = max((len(s) for s in stop or ()), default=1) - 1
    return text if finished or not hold else text[:max(0, len(text) - hold)]


class PrefillWorker(Worker):
    """A prefill worker with its dependencies passed in (serve() builds the real ones)."""

    role = "prefill"

    def __init__(self, cfg: PrefillConfig, engine: Any, kvstore: Any, index: Any,
                 metrics: Optional[Metrics] = None, tracer: Optional[trace.Tracer] = None) -> None:
        super().__init__(cfg, engine, kvstore, index, metrics)
        self.servicer = PrefillServicer(self.runtime, self.transfer, list(cfg.kvstore),
                                        tracer or trace.get_tracer("kvmesh.prefill"))
        self.runtime.add_servicer(lambda s: pb_grpc.add_PrefillServicer_to_server(self.servicer, s))


async def serve(cfg: PrefillConfig, on_ready: Callable[[], None] = lambda: None) -> None:
    """Runs a prefill worker until cancelled (kvmesh prefill ...); `on_ready()` once it serves."""
    await serve_worker(cfg, PrefillWorker, on_ready)
