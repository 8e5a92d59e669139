"""kvstore benchmark: put/get throughput over loopback gRPC (1 MiB blocks by default) and index lookups/s.

    .venv/bin/python benchmarks/kvstore.py [--total-mib 512] [--block-kib 1024] [--streams 4] [--lookups 2000]
        [--shared-memory-mib 0,64]

The kvstore runs as its own process (`python -m kvmesh.kvstore`), as in a deployment; the client is
GrpcKVStoreClient. Index lookups are of 256 hashes each (a 4,096-token prompt at block size 16), half
of them held, against MemoryIndex and RedisIndex (a real redis-server started here).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from redis_server import RedisServer, free_port  # noqa: E402

from kvmesh.index import MemoryIndex, RedisIndex  # noqa: E402
from kvmesh.kvstore.client import GrpcKVStoreClient, StoredBlock  # noqa: E402

MiB = 1 << 20


async def wait_serving(address: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.KVStore"), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.1)


def proc_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench_transfer(total_mib: int, streams: int, batch: int, device: str, block_bytes: int,
                         shared_mib: int = 0) -> dict[str, float]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.kvstore", "--port", str(port), "--device", device,
                             "--capacity-bytes", str((total_mib + 64) * MiB), "--block-bytes", str(block_bytes)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        await wait_serving(address)
        client = GrpcKVStoreClient([address], shared_memory_bytes=shared_mib * MiB)
        payload = os.urandom(block_bytes)  # distinct blocks differ in their first bytes
        blocks = [StoredBlock(i.to_bytes(32, "big"), list(range(16)), i.to_bytes(8, "big") + payload[8:], "bench")
                  for i in range(total_mib * MiB // block_bytes)]
        for b in blocks:
            b.checksum()  # the producer (prefill) computes it once when it exports the block
        batches = [blocks[i:i + batch] for i in range(0, len(blocks), batch)]
        await client.put(blocks[:2])  # warm up the channel

        cpu = {}

        async def run(name, fn, work):
            queue = list(work)

            async def worker():
                while queue:
                    await fn(queue.pop())
            t0, c0, s0 = time.perf_counter(), time.process_time(), proc_cpu_seconds(proc.pid)
            await asyncio.gather(*(worker() for _ in range(streams)))
            cpu[name] = ((time.process_time() - c0) * 1e3 / total_mib, (proc_cpu_seconds(proc.pid) - s0) * 1e3 / total_mib)
            return time.perf_counter() - t0

        put_s = await run("put", client.put, batches)
        got_bytes = 0

        async def get(bs):
            nonlocal got_bytes
            out = await client.get([b.hash for b in bs])
            got_bytes += sum(len(o.data) for o in out if o is not None)
        get_s = await run("get", get, batches)
        await client.close()
        if got_bytes != len(blocks) * block_bytes:
            raise RuntimeError(f"got {got_bytes} bytes back, expected {len(blocks) * block_bytes}")
        return {"put": total_mib * MiB / put_s / 1e9, "get": total_mib * MiB / get_s / 1e9, "cpu": cpu}
    finally:
        proc.terminate()
        proc.wait(10)


async def bench_index(index, lookups: int) -> float:
    hashes = [os.urandom(32) for _ in range(256)]
    await index.publish("127.0.0.1:50061", hashes[::2], [])
    await index.lookup(hashes)
    t0 = time.perf_counter()
    for _ in range(lookups):
        got = await index.lookup(hashes)
    dt = time.perf_counter() - t0
    assert sum(1 for g in got if g) == 128
    return lookups / dt


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=512, help="MiB moved each way")
    ap.add_argument("--block-kib", type=int, default=1024, help="block size in KiB (SmolLM2 fp16: 360)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent put/get streams")
    ap.add_argument("--batch", type=int, default=16, help="blocks per put/get call")
    ap.add_argument("--lookups", type=int, default=2000, help="256-hash index lookups per backend")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="where the kvstore pool lives")
    ap.add_argument("--shared-memory-mib", default="0",
                    help="the client's shared-memory segment (0: gRPC messages only), e.g. 0,64: a row each")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    rows = []
    for shared in map(int, args.shared_memory_mib.split(",")):
        t = await bench_transfer(args.total_mib, args.streams, args.batch, args.device, args.block_kib * 1024, shared)
        how = f"shared memory ({shared} MiB)" if shared else "loopback gRPC"
        for op in ("put", "get"):
            client_ms, server_ms = t["cpu"][op]
            rows.append((f"kvstore {op}, {args.block_kib} KiB blocks, {how}, {args.device} pool", f"{t[op]:.2f} GB/s"))
            rows.append(("  CPU ms per MiB: client | kvstore process", f"{client_ms:.2f} | {server_ms:.2f}"))
    mem = MemoryIndex()
    rows.append(("index lookup, 256 hashes, MemoryIndex", f"{await bench_index(mem, args.lookups):,.0f} lookups/s"))
    try:
        with RedisServer() as server:
            red = RedisIndex(server.url)
            rate = f"{await bench_index(red, args.lookups):,.0f} lookups/s"
            await red.close()
    except RuntimeError as exc:  # e.g. a GPU host without redis-server
        rate = f"skipped ({exc})"
    rows.append(("index lookup, 256 hashes, RedisIndex", rate))
    width = max(len(r[0]) for r in rows)
    print(f"{'benchmark':<{width}}  result")
    print(f"{'-' * width}  {'-' * 18}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"({args.total_mib} MiB each way, {args.streams} streams x {args.batch} blocks per call; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    asyncio.run(main())
