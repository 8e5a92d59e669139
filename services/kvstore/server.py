"""kvstore gRPC server: a thin servicer over BlockStore, health checking, index publishing.

    KVStoreServer(cfg).start() -> port     (tests, embedding)
    serve(cfg)                             (runs until cancelled, then stops gracefully)
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.index import PrefixIndex, make_index
from kvmesh.kvstore.chunks import (GRPC_OPTIONS, StreamError, assemble, batch_chunks, block_chunk_parts, block_header,
                                   decode_batch, decode_chunk, missing_chunk_parts, unbatched)
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.malloc import tune_malloc
from kvmesh.kvstore.publisher import IndexPublisher
from kvmesh.kvstore.pull_gate import PullGate
from kvmesh.kvstore.shm_segments import SegmentUnavailable, SharedSegments
from kvmesh.kvstore.store import BlockStore, ChecksumError, PutResult
from kvmesh.telemetry import Metrics, MetricsServer, start_metrics_server
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "kvmesh.v1.KVStore"


async def _assembled(chunks):
    """(header, data) of each block of a Put / PutBatched chunk stream (none may be flagged missing)."""
    async for header, data in assemble(chunks):
        if data is None:
            raise StreamError(f"Put: block {header.hash.hex()[:16]} is flagged missing")
        yield header, data


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore, chunk_bytes: int, metrics: Metrics | None = None,
                 gate: PullGate | None = None) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.metrics = metrics
        self.gate = gate if gate is not None else PullGate(0.0)  # pulls before pushes (off: arrival order)
        self.segments = SharedSegments()  # clients' shared memory (PutShared / GetShared)
        self._allocation: asyncio.Future | None = None  # the first put's slabs, allocated once

    def _timed(self, op: str):
        return self.metrics.time_transfer(op) if self.metrics is not None else contextlib.nullcontext()

    async def Put(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PutReply:
        return await self._put(_assembled(request_iterator), context)

    async def PutBatched(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PutReply:
        return await self._put(_assembled(unbatched(request_iterator)), context)

    async def PutShared(self, request: pb.SharedPut, context: grpc.aio.ServicerContext) -> pb.PutReply:
        return await self._put(self._shared(request), context)

    async def _shared(self, request: pb.SharedPut):
        """(header, view of its bytes in the client's segment) of each block of a PutShared; a view
        is released once the block is stored."""
        for b in request.blocks:
            with self.segments.view(request.segment, b.offset, b.header.size) as data:
                yield b.header, data

    async def _put(self, blocks, context: grpc.aio.ServicerContext) -> pb.PutReply:
        """Stores (header, data) pairs as they come, giving way to gets between slices (PullGate);
        a bad one ends the call with its status."""
        counts = {r: 0 for r in PutResult}
        try:
            with self._timed("put"):
                try:
                    async with contextlib.aclosing(blocks):
                        stored = 0
                        async for header, data in blocks:
                            if not header.hash:
                                raise StreamError("Put: a block header has an empty hash")
                            if self.store.slot_bytes is None:
                                await self._allocate(len(data))
                            counts[self.store.put(header.hash, data, header.token_ids, header.layout,
                                                  header.crc32)] += 1
                            stored += 1
                            await self.gate.after_block(stored)
                finally:  # the call's blocks into GPU memory in one copy
                    self.store.flush()
        except SegmentUnavailable as exc:  # PutShared from another host or container
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ChecksumError as exc:
            await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        except ValueError as exc:  # StreamError, oversized block, a range outside the segment, another name
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.PutReply(stored=counts[PutResult.STORED], already_held=counts[PutResult.ALREADY_HELD],
                           rejected=counts[PutResult.REJECTED])

    async def _allocate(self, slot_bytes: int) -> None:
        """The slabs, sized by the first block put, in a thread: touching a 1 GiB host slab's pages
        took the event loop 3-4 s on the build machine (every call, health checks too, waited; a
        larger pool outlasts the clients' deadlines). Puts wait for it; gets find nothing meanwhile.
        One allocation, shielded: a put whose deadline ends while it runs leaves it running, and
        the next put waits for it. (Behind a lock, a cancelled put let the next start a second
        one, whose slab replaced the first with the blocks stored in it: three, under py-spy.)"""
        a = self._allocation
        if a is None or (a.done() and (a.cancelled() or a.exception() is not None)):  # none, or failed
            a = self._allocation = asyncio.ensure_future(asyncio.to_thread(self.store.allocate, slot_bytes))
        await asyncio.shield(a)

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext):
        async for parts in self._get(request):
            yield b"".join(parts)

    async def GetBatched(self, request: pb.GetRequest, context: grpc.aio.ServicerContext):
        chunks = [parts async for parts in self._get(request)]  # the blocks are read in one copy anyway
        for message in batch_chunks(chunks, self.chunk_bytes):
            yield message

    async def _get(self, request: pb.GetRequest):
        """Each chunk of the requested blocks, in order, as its wire pieces."""
        with self._timed("get"):
            hashes, blocks = await self._read(request)
            for h, block in zip(hashes, blocks):
                if block is None:
                    yield missing_chunk_parts(h)
                    continue
                for parts in block_chunk_parts(block, self.chunk_bytes):
                    yield parts

    async def _read(self, request: pb.GetRequest) -> tuple[list[bytes], list]:
        """(hashes, blocks or None) of a get, leased first: later blocks must survive while earlier
        ones stream. The blocks held in GPU memory come in one copy, waited for off the event loop."""
        hashes = list(request.hashes)
        with self.gate.pulling():
            self.store.lease(hashes, request.lease_holder, request.lease_seconds)
            return hashes, await self.store.get_many(hashes, request.lease_holder, request.lease_seconds).gather()

    async def GetShared(self, request: pb.SharedGet, context: grpc.aio.ServicerContext) -> pb.SharedBlocks:
        out = []
        try:
            with self._timed("get"), self.gate.pulling():  # until its blocks are in the segment
                hashes, blocks = await self._read(request.request)
                offset, end = request.offset, request.offset + request.capacity
                for h, block in zip(hashes, blocks):
                    if block is None:
                        out.append(pb.SharedBlock(header=pb.BlockHeader(hash=h, missing=True)))
                        continue
                    n = len(block.data)
                    if offset + n > end:
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"GetShared: the blocks need more than the {request.capacity} bytes given")
                    with self.segments.view(request.segment, offset, n) as dst:
                        dst[:] = block.data
                    out.append(pb.SharedBlock(offset=offset, header=block_header(block)))
                    offset += n
        except SegmentUnavailable as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.SharedBlocks(blocks=out)

    async def Contains(self, request: pb.ContainsRequest, context) -> pb.ContainsReply:
        return pb.ContainsReply(present=self.store.contains(list(request.hashes)))

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseReply:
        return pb.ReleaseReply(released=self.store.release(list(request.hashes), request.lease_holder))

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        s = self.store.stats()
        return pb.StatsReply(**dataclasses.asdict(s))

    def handler(self) -> grpc.GenericRpcHandler:
        """Like the generated add_KVStoreServicer_to_server, but BlockChunks skip protobuf objects:
        Put receives (header, memoryview) pairs (PutBatched lists of them) and Get and GetBatched
        send pre-encoded bytes (see chunks.py)."""
        reply = lambda msg: msg.SerializeToString()  # noqa: E731
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Put": grpc.stream_unary_rpc_method_handler(self.Put, request_deserializer=decode_chunk,
                                                        response_serializer=reply),
            "Get": grpc.unary_stream_rpc_method_handler(self.Get, request_deserializer=pb.GetRequest.FromString,
                                                        response_serializer=None),
            "PutBatched": grpc.stream_unary_rpc_method_handler(self.PutBatched, request_deserializer=decode_batch,
                                                               response_serializer=reply),
            "GetBatched": grpc.unary_stream_rpc_method_handler(
                self.GetBatched, request_deserializer=pb.GetRequest.FromString, response_serializer=None),
            "PutShared": grpc.unary_unary_rpc_method_handler(
                self.PutShared, request_deserializer=pb.SharedPut.FromString, response_serializer=reply),
            "GetShared": grpc.unary_unary_rpc_method_handler(
                self.GetShared, request_deserializer=pb.SharedGet.FromString, response_serializer=reply),
            "Contains": grpc.unary_unary_rpc_method_handler(
                self.Contains, request_deserializer=pb.ContainsRequest.FromString, response_serializer=reply),
            "Release": grpc.unary_unary_rpc_method_handler(
                self.Release, request_deserializer=pb.ReleaseRequest.FromString, response_serializer=reply),
            "Stats": grpc.unary_unary_rpc_method_handler(
                self.Stats, request_deserializer=pb.StatsRequest.FromString, response_serializer=reply),
        })


class KVStoreServer:
    """One kvstore node: gRPC server + store + index publisher. Dependencies may be passed in."""

    def __init__(self, cfg: KVStoreConfig, store: BlockStore | None = None,
                 index: PrefixIndex | None = None) -> None:
        self.cfg = cfg
        self.store = store if store is not None else BlockStore(cfg)
        self.index = index if index is not None else make_index(cfg.redis_url)
        self._owns_index = index is None
        self._server: grpc.aio.Server | None = None
        self._servicer: KVStoreServicer | None = None
        self._health = health.aio.HealthServicer()
        self.publisher: IndexPublisher | None = None
        self.port: int | None = None
        self.metrics = Metrics(role="kvstore") if cfg.metrics_port is not None else None
        self.metrics_server: MetricsServer | None = None
        self._metrics_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        """host:port this node is reached at and published under in the index."""
        return dataclasses.replace(self.cfg, port=self.port or self.cfg.port).holder

    async def start(self) -> int:
        tune_malloc()
        server = grpc.aio.server(options=GRPC_OPTIONS + [("grpc.so_reuseport", 0)])
        servicer = self._servicer = KVStoreServicer(self.store, self.cfg.chunk_bytes, self.metrics,
                                                    PullGate(self.cfg.put_yield_seconds))
        server.add_generic_rpc_handlers((servicer.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self.port = server.add_insecure_port(f"{self.cfg.host}:{self.cfg.port}")
        if self.port == 0:
            raise OSError(f"kvstore: cannot bind {self.cfg.host}:{self.cfg.port} (is --port in use?)")
        await server.start()
        self._server = server
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.publisher = IndexPublisher(self.store, self.index, self.address, self.cfg.publish_interval)
        self.publisher.start()
        if self.metrics is not None:
            self.metrics_server = await start_metrics_server(self.metrics, self.cfg.host, self.cfg.metrics_port)
            self._metrics_task = asyncio.create_task(self._refresh_metrics())
        log.info("kvstore serving on %s (pool on %s)", self.address, self.store.device)
        return self.port

    async def _refresh_metrics(self, interval: float = 1.0) -> None:
        """Copy the store's counters into the Prometheus metrics (cheap; scrapes are seconds apart)."""
        while True:
            self.update_metrics()
            await asyncio.sleep(interval)

    def update_metrics(self) -> None:
        s = self.store.stats()
        self.metrics.update_from_store_stats(blocks_held=s.blocks_held, capacity_blocks=s.capacity_blocks,
                                             blocks_evicted=s.blocks_evicted, bytes_in=s.bytes_in,
                                             bytes_out=s.bytes_out, put_wait_seconds=self._servicer.gate.waited_s)

    async def stop(self, grace: float = 2.0) -> None:
        """Stop taking work, let streams in flight finish for `grace` s, withdraw from the index."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        self._server = None
        self._servicer.segments.close()
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            await self.metrics_server.close()
        try:
            await self.publisher.stop()
        except Exception as exc:  # the index entries expire by TTL anyway
            log.warning("kvstore: could not withdraw %s from the prefix index: %s", self.address, exc)
        if self._owns_index:
            await self.index.close()


async def serve(cfg: KVStoreConfig, on_ready: Callable[[], None] = lambda: None) -> None:
    """Run a kvstore node until cancelled; `on_ready()` once it serves."""
    server = KVStoreServer(cfg)
    await server.start()
    on_ready()
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.shield(server.stop())
