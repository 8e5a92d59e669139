"""gRPC clients of the prefill and decode workers (kvmesh.v1.Prefill / kvmesh.v1.Decode), plus health.

One channel per worker address, kept for the gateway's life. `generate` returns the live call so
the caller can cancel it: cancelling the call is what tells the decode worker to abort and free
the request's blocks. Every call carries the caller's trace context (`traceparent` metadata), so a
worker's span joins the gateway's HTTP request span.
"""
from __future__ import annotations

from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.telemetry import tracing_client_interceptors
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc

# Prefill replies carry the prompt's full-precision tail KV: allow large messages.
_MAX_MSG = 256 * 1024 * 1024
CHANNEL_OPTIONS = (("grpc.max_send_message_length", _MAX_MSG),
                   ("grpc.max_receive_message_length", _MAX_MSG),
                   ("grpc.keepalive_time_ms", 20000))


class WorkerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS,
                                                 interceptors=tracing_client_interceptors())
        self._prefill = pb_grpc.PrefillStub(self.channel)
        self._decode = pb_grpc.DecodeStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def prefill(self, req: pb.PrefillRequest, timeout: float) -> grpc.aio.UnaryUnaryCall:
        """The live call (await it for the reply; `cancel()` abandons it)."""
        return self._prefill.Prefill(req, timeout=timeout)

    def generate(self, req: pb.GenerateRequest, timeout: float) -> grpc.aio.UnaryStreamCall:
        return self._decode.Generate(req, timeout=timeout)

    async def healthy(self, timeout: float = 1.0) -> Optional[bool]:
        """True if the worker says it serves, False if it says not or cannot be reached, None if it did
        not answer in time (busy or hung: the router decides after how many, `Router.observe`)."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return None if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def load(self, role: str, timeout: float = 1.0) -> Optional[pb.LoadReply]:
        """The worker's own load (all gateways' requests); None if it cannot say (down, or too old
        to serve Load)."""
        stub = self._prefill if role == "prefill" else self._decode
        try:
            return await stub.Load(pb.LoadRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return None

    async def close(self) -> None:
        await self.channel.close()


class WorkerClients:
    """Address -> client for every configured worker."""

    def __init__(self, addresses: list[str]) -> None:
        self._clients = {a: WorkerClient(a) for a in addresses}

    def __getitem__(self, address: str) -> WorkerClient:
        return self._clients[address]

    def __iter__(self):
        return iter(self._clients.values())

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
