"""kvstore clients: one interface, two transports (gRPC over several nodes, in-process).

GrpcKVStoreClient shards blocks over nodes by rendezvous hashing of the block hash over the nodes it
believes alive. A node whose call fails is down until it answers a health check (`NodeLiveness`):
new puts go to the next node in rendezvous order, gets ask the new owner (a miss there costs a
recompute, never an error). A call's deadline grows with its bytes (`call_deadline`), so a hung node
costs the calls in flight seconds, not the 30 s ceiling.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Iterable, Protocol, runtime_checkable

import grpc

from kvmesh.kvstore import checksum
from kvmesh.kvstore.block import StoredBlock
from kvmesh.kvstore.chunks import (GRPC_OPTIONS, assemble, batch_chunks, block_chunk_parts, block_header, decode_batch,
                                   unbatched)
from kvmesh.kvstore.malloc import tune_malloc
from kvmesh.kvstore.node_liveness import NODE_DOWN, NodeLiveness
from kvmesh.kvstore.rendezvous import node_for
from kvmesh.shm_arena import SegmentRange, ShmArena
from kvmesh.kvstore.store import BlockStore, PutResult
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc

__all__ = ["StoredBlock", "KVStoreClient", "GrpcKVStoreClient", "LocalKVStoreClient", "node_for",
           "KVStoreUnavailable", "BlockCorrupted"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
CALL_BASE_S = 5.0  # a call's deadline: this, plus its bytes at MIN_BYTES_PER_S, at most `timeout`
MIN_BYTES_PER_S = 50e6  # far below any path measured (loopback gRPC on a loaded 2-core machine: 570 MB/s)


def call_deadline(nbytes: int, ceiling: float) -> float:
    """Seconds a kvstore call moving `nbytes` may take."""
    return min(ceiling, CALL_BASE_S + nbytes / MIN_BYTES_PER_S)


class KVStoreUnavailable(ConnectionError):
    """No kvstore node answered."""


class BlockCorrupted(ValueError):
    """A block arrived whose bytes do not match its crc32."""


@runtime_checkable
class KVStoreClient(Protocol):
    async def put(self, blocks: list[StoredBlock]) -> int:
        """Store blocks; returns how many the store now holds from this call (stored or already held)."""
        ...

    async def get(self, hashes: list[bytes], lease_holder: str = "", lease_seconds: float = 0.0,
                  into: SegmentRange | None = None) -> list[StoredBlock | None]:
        """Blocks in order, None where missing; leases what it returns when lease_seconds > 0.
        `into`: a range of this host's shared memory the blocks may be written into, back to back
        (each such block's `shared` then names its spot and its data views it); a transport that
        cannot leaves it alone."""
        ...

    async def contains(self, hashes: list[bytes]) -> list[bool]:
        """Which blocks are held. Never renews a lease."""
        ...

    async def release(self, hashes: list[bytes], lease_holder: str) -> None:
        ...

    async def close(self) -> None:
        ...


class LocalKVStoreClient:
    """In-process transport over a BlockStore (tests, kvmesh.LLM). Copies data like the wire would."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store

    async def put(self, blocks: list[StoredBlock]) -> int:
        held = 0
        for b in blocks:
            r = self.store.put(b.hash, b.data, b.token_ids, b.layout, b.crc32)
            held += r is not PutResult.REJECTED
        self.store.flush()
        return held

    async def get(self, hashes: list[bytes], lease_holder: str = "", lease_seconds: float = 0.0,
                  into: SegmentRange | None = None) -> list[StoredBlock | None]:
        self.store.lease(hashes, lease_holder, lease_seconds)
        return await self.store.get_many(hashes, lease_holder, lease_seconds).gather()

    async def contains(self, hashes: list[bytes]) -> list[bool]:
        return self.store.contains(hashes)

    async def release(self, hashes: list[bytes], lease_holder: str) -> None:
        self.store.release(hashes, lease_holder)

    async def close(self) -> None:
        pass


def _checked(node: str, header: pb.BlockHeader, data: bytes | memoryview,
             shared: tuple[str, int] | None = None) -> StoredBlock:
    """The block a get received, its bytes checked against the crc32 its header carries."""
    if checksum.crc32(data) != header.crc32:
        raise BlockCorrupted(f"block {header.hash.hex()[:16]} from kvstore {node}: crc32 mismatch")
    return StoredBlock(header.hash, list(header.token_ids), data, header.layout, crc32=header.crc32, shared=shared)


class _Stub(pb_grpc.KVStoreStub):
    """The generated stub, with PutBatched/GetBatched carrying pre-encoded / lazily decoded chunk
    batches (chunks.py)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(channel)
        self.PutBatched = channel.stream_unary("/kvmesh.v1.KVStore/PutBatched", request_serializer=None,
                                               response_deserializer=pb.PutReply.FromString)
        self.GetBatched = channel.unary_stream("/kvmesh.v1.KVStore/GetBatched",
                                               request_serializer=pb.GetRequest.SerializeToString,
                                               response_deserializer=decode_batch)


class GrpcKVStoreClient:
    """`shared_memory_bytes` > 0: blocks move through a segment of that size in /dev/shm (`ShmArena`)
    with the nodes that can open it (the same host), through gRPC messages with the others and
    whenever the segment has no room for a call. A shared get reserves `block_bytes` a block (the
    largest block seen, if larger; until one is known, gets use messages)."""

    def __init__(self, addresses: list[str], *, timeout: float = 30.0, probe_interval_s: float = 1.0,
                 chunk_bytes: int = CHUNK_BYTES, shared_memory_bytes: int = 0, block_bytes: int = 0) -> None:
        if not addresses:
            raise ValueError("GrpcKVStoreClient: addresses is empty (pass at least one kvstore host:port)")
        tune_malloc()  # 1 MiB messages: keep freed buffers for reuse (see malloc.py)
        self.addresses = list(dict.fromkeys(addresses))
        self.timeout = timeout  # the ceiling of every call's deadline
        self.chunk_bytes = chunk_bytes
        self._channels = {a: grpc.aio.insecure_channel(a, options=GRPC_OPTIONS) for a in self.addresses}
        self._stubs = {a: _Stub(c) for a, c in self._channels.items()}
        self.liveness = NodeLiveness(self._channels, probe_interval_s=probe_interval_s)
        self._arena = ShmArena.create(shared_memory_bytes) if shared_memory_bytes > 0 else None
        self._no_shm: set[str] = set()  # nodes that could not open the segment
        self._block_bytes = block_bytes  # what a shared get reserves a block: the largest seen

    # -- liveness ------------------------------------------------------------------------------
    def live_nodes(self) -> list[str]:
        return self.liveness.live()

    def _deadline(self, nbytes: int = 0) -> float:
        return call_deadline(nbytes, self.timeout)

    def _group(self, hashes: Iterable[bytes], live: list[str]) -> dict[str, list[int]]:
        """Indices of `hashes` per owning node."""
        if not live:
            raise KVStoreUnavailable(f"no kvstore node is reachable among {self.addresses}")
        groups: dict[str, list[int]] = {}
        for i, h in enumerate(hashes):
            groups.setdefault(node_for(h, live), []).append(i)
        return groups

    async def _sharded(self, hashes: list[bytes], call) -> dict[int, object]:
        """Run `call(node, indices)` per owner in parallel; re-shard the indices of failed nodes."""
        results: dict[int, object] = {}
        pending = list(range(len(hashes)))
        while pending:
            live = self.live_nodes()
            groups = self._group([hashes[i] for i in pending], live)
            groups = {node: [pending[j] for j in idx] for node, idx in groups.items()}
            outs = await asyncio.gather(*(call(node, idx) for node, idx in groups.items()),
                                        return_exceptions=True)
            pending = []
            for (node, idx), out in zip(groups.items(), outs):
                if isinstance(out, grpc.aio.AioRpcError) and out.code() in NODE_DOWN:
                    self.liveness.mark_down(node, out)
                    pending.extend(idx)
                elif isinstance(out, BaseException):
                    raise out
                else:
                    results.update(zip(idx, out))
        return results

    # -- the interface -------------------------------------------------------------------------
    async def put(self, blocks: list[StoredBlock]) -> int:
        held = 0  # the reply counts per call, not per block

        async def call(node: str, idx: list[int]) -> list[None]:
            nonlocal held
            reply = await self._put_shared(node, [blocks[i] for i in idx]) if self._shares(node) else None
            if reply is not None:
                held += reply.stored + reply.already_held
                return [None] * len(idx)

            def chunks():
                for i in idx:
                    yield from block_chunk_parts(blocks[i], self.chunk_bytes)
            reply = await self._stubs[node].PutBatched(batch_chunks(chunks(), self.chunk_bytes),
                                                       timeout=self._deadline(sum(len(blocks[i].data) for i in idx)))
            held += reply.stored + reply.already_held
            return [None] * len(idx)

        self._block_bytes = max([self._block_bytes] + [len(b.data) for b in blocks])
        await self._sharded([b.hash for b in blocks], call)
        return held

    async def get(self, hashes: list[bytes], lease_holder: str = "", lease_seconds: float = 0.0,
                  into: SegmentRange | None = None) -> list[StoredBlock | None]:
        """`into` serves a call to one node for every hash (a range holds one node's blocks back to
        back); the blocks written there are views into it, checked in place."""
        async def call(node: str, idx: list[int]) -> list[StoredBlock | None]:
            req = pb.GetRequest(hashes=[hashes[i] for i in idx], lease_holder=lease_holder,
                                lease_seconds=lease_seconds)
            if self._shares(node) and (self._block_bytes or into is not None):
                target = into if into is not None and len(idx) == len(hashes) else None
                shared = await self._get_shared(node, req, target)
                if shared is not None:
                    return shared
            out: list[StoredBlock | None] = []
            deadline = self._deadline(len(idx) * self._block_bytes)
            async for header, data in assemble(unbatched(self._stubs[node].GetBatched(req, timeout=deadline))):
                if data is None:
                    out.append(None)
                    continue
                # a view into the message (or the assembly buffer): own it
                out.append(_checked(node, header, bytes(data)))
                self._block_bytes = max(self._block_bytes, len(data))
            if len(out) != len(idx):
                raise ValueError(f"kvstore {node} answered {len(out)} blocks for {len(idx)} hashes")
            return out

        out = await self._sharded(hashes, call)
        return [out[i] for i in range(len(hashes))]

    async def contains(self, hashes: list[bytes]) -> list[bool]:
        async def call(node: str, idx: list[int]) -> list[bool]:
            reply = await self._stubs[node].Contains(pb.ContainsRequest(hashes=[hashes[i] for i in idx]),
                                                     timeout=self._deadline())
            return list(reply.present)

        out = await self._sharded(hashes, call)
        return [out[i] for i in range(len(hashes))]

    async def release(self, hashes: list[bytes], lease_holder: str) -> None:
        async def call(node: str, idx: list[int]) -> list[None]:
            await self._stubs[node].Release(pb.ReleaseRequest(hashes=[hashes[i] for i in idx],
                                                              lease_holder=lease_holder), timeout=self._deadline())
            return [None] * len(idx)

        await self._sharded(hashes, call)

    async def stats(self) -> dict[str, pb.StatsReply]:
        """Stats of every configured node (dead ones omitted)."""
        out = {}
        for node, stub in self._stubs.items():
            try:
                out[node] = await stub.Stats(pb.StatsRequest(), timeout=self._deadline())
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in NODE_DOWN:
                    raise
        return out

    async def close(self) -> None:
        await self.liveness.close()
        await asyncio.gather(*(c.close() for c in self._channels.values()))
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    # -- shared memory (one host) ----------------------------------------------------------------
    def _shares(self, node: str) -> bool:
        return self._arena is not None and node not in self._no_shm

    def _shm_refused(self, node: str, exc: grpc.aio.AioRpcError) -> bool:
        """Whether the call failed for want of the segment there (then never asked again)."""
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            return False
        log.info("kvstore node %s cannot open this client's shared memory (%s); using gRPC messages", node,
                 exc.details())
        self._no_shm.add(node)
        return True

    async def _put_shared(self, node: str, blocks: list[StoredBlock]) -> pb.PutReply | None:
        """PutShared, or None where the segment has no room or the node cannot open it. Blocks that
        already lie in one shared segment (`StoredBlock.shared`) are named where they are."""
        segments = {b.shared[0] if b.shared else None for b in blocks}
        if len(segments) == 1 and None not in segments:
            refs = [pb.SharedBlock(offset=b.shared[1], header=block_header(b)) for b in blocks]
            return await self._shared_put(node, pb.SharedPut(segment=segments.pop(), blocks=refs))
        total = sum(len(b.data) for b in blocks)
        start = self._arena.alloc(total)
        if start is None:
            return None
        try:
            refs, offset = [], start
            for b in blocks:
                n = len(b.data)
                self._arena.view(offset, n)[:] = b.data
                refs.append(pb.SharedBlock(offset=offset, header=block_header(b)))
                offset += n
            return await self._shared_put(node, pb.SharedPut(segment=self._arena.name, blocks=refs))
        finally:
            self._arena.free(start, total)

    async def _shared_put(self, node: str, req: pb.SharedPut) -> pb.PutReply | None:
        try:
            nbytes = sum(b.header.size for b in req.blocks)
            return await self._stubs[node].PutShared(req, timeout=self._deadline(nbytes))
        except grpc.aio.AioRpcError as exc:
            if self._shm_refused(node, exc):
                return None
            raise

    async def _get_shared(self, node: str, req: pb.GetRequest, into: SegmentRange | None = None
                          ) -> list[StoredBlock | None] | None:
        """GetShared into `into`, or into a range of this client's segment reserved for the largest
        block seen; None where there is no room, the node cannot open the segment or a block does
        not fit (then a GetBatched). Blocks in `into` are views into it; others are copied out."""
        if into is None:
            if not self._block_bytes:
                return None
            capacity = len(req.hashes) * self._block_bytes
            start = self._arena.alloc(capacity)
            if start is None:
                return None
            target = SegmentRange(self._arena.name, start, capacity, self._arena.view(start, capacity))
        else:
            target = into
        try:
            reply = await self._stubs[node].GetShared(pb.SharedGet(
                request=req, segment=target.segment, offset=target.offset, capacity=target.nbytes),
                timeout=self._deadline(target.nbytes))
            out: list[StoredBlock | None] = []
            for ref in reply.blocks:
                h = ref.header
                if h.missing:
                    out.append(None)
                    continue
                data = target.view(ref.offset, h.size)  # ValueError: the node wrote outside the range
                if into is None:  # this client's range is reused next: own the bytes
                    out.append(_checked(node, h, bytes(data)))
                else:
                    out.append(_checked(node, h, data, shared=(target.segment, ref.offset)))
            if len(out) != len(req.hashes):
                raise ValueError(f"kvstore {node} answered {len(out)} blocks for {len(req.hashes)} hashes")
            return out
        except grpc.aio.AioRpcError as exc:
            if self._shm_refused(node, exc) or exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None  # RESOURCE_EXHAUSTED: a block larger than any seen; the batched get learns it
            raise
        finally:
            if into is None:
                self._arena.free(target.offset, target.nbytes)
