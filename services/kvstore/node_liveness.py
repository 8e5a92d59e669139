"""NodeLiveness: which kvstore nodes a client sends its calls to.

A node whose call fails with UNAVAILABLE, DEADLINE_EXCEEDED or CANCELLED is down: calls skip it
(puts go to the next node in rendezvous order, gets ask the new owner, where a miss costs a
recompute) until it answers a gRPC health check. The checks run in the background, one every
`probe_interval_s` with a `probe_timeout_s` deadline, so no request pays to find out whether a node
is back. Before, a node came back on a timer (5 s) and the first calls after it paid their whole
deadline again where it still hung: a stopped (SIGSTOP) kvstore cost every request 61 s, a 30 s put
and a 30 s get (tests/test_outages.py).
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("kvmesh.kvstore.client")

NODE_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class NodeLiveness:
    def __init__(self, channels: dict[str, grpc.aio.Channel], *, probe_interval_s: float = 1.0,
                 probe_timeout_s: float = 1.0) -> None:
        self.addresses = list(channels)
        self._health = {a: health_pb2_grpc.HealthStub(c) for a, c in channels.items()}
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._probes: dict[str, asyncio.Task] = {}  # node -> its health checks while it is down

    def live(self) -> list[str]:
        return [a for a in self.addresses if a not in self._probes]

    def mark_down(self, node: str, exc: grpc.aio.AioRpcError) -> None:
        if node in self._probes:
            return
        log.warning("kvstore node %s failed (%s); routing around it until it answers a health check", node,
                    exc.code().name)
        self._probes[node] = asyncio.create_task(self._probe(node, time.monotonic()), name=f"kvstore-probe-{node}")

    async def _probe(self, node: str, since: float) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                reply = await self._health[node].Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout_s)
            except grpc.aio.AioRpcError:
                continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                break
        del self._probes[node]
        log.warning("kvstore node %s answers again after %.1f s; sending it calls", node, time.monotonic() - since)

    async def close(self) -> None:
        probes = list(self._probes.values())
        for t in probes:
            t.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        self._probes.clear()
