"""kvstore under a disaggregated burst's mix: how long a pull (get) takes while pushes (puts) stream in,
with the kvstore's pulls-first gate at each `--put-yield-seconds` setting, side by side in one run.

    .venv/bin/python benchmarks/kvstore_mixed.py [--yield-seconds 0,0.02] [--rounds 2] [--device cpu]
        [--block-kib 103] [--blocks-per-call 64] [--put-streams 4] [--seconds 6]

Each round starts one kvstore process (`python -m kvmesh.kvstore`) per setting, in turn (the order
alternates between rounds). A separate process pushes fresh blocks from `--put-streams` streams
(PutShared, as a prefill worker on the same host does) for `--seconds`; meanwhile this process pulls
held blocks, one request's worth a call (`--blocks-per-call`, GetShared), one pull at a time with a
short pause between, and times each. A table row per setting: the pull's latency when the kvstore
is idle and under the pushes (p50 / p90 / p99), a get's mean time inside the kvstore (its
store_transfer_seconds, idle and loaded), the pushes' throughput, and the seconds puts waited for
gets (store_put_wait_seconds), both per round.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from kvstore import wait_serving  # noqa: E402
from redis_server import free_port  # noqa: E402

from kvmesh.kvstore.client import GrpcKVStoreClient, StoredBlock  # noqa: E402

MiB = 1 << 20


def make_blocks(first: int, n: int, block_bytes: int) -> list[StoredBlock]:
    payload = os.urandom(block_bytes)  # distinct blocks differ in their first bytes
    blocks = [StoredBlock((first + i).to_bytes(32, "big"), list(range(16)), (first + i).to_bytes(8, "big")
                          + payload[8:], "bench") for i in range(n)]
    for b in blocks:
        b.checksum()  # the producer computes it once when it exports the block
    return blocks


async def push(address: str, block_bytes: int, per_call: int, streams: int, seconds: float) -> None:
    """The pushing process: fresh blocks until `seconds` pass; prints the bytes a second it pushed."""
    client = GrpcKVStoreClient([address], shared_memory_bytes=max(64 * MiB, 2 * streams * per_call * block_bytes))
    calls = [make_blocks(10 ** 6 + i * per_call, per_call, block_bytes) for i in range(4 * streams)]
    end = time.monotonic() + seconds
    moved = 0

    async def stream(k: int) -> None:
        nonlocal moved
        i = k
        while time.monotonic() < end:
            lap, call = divmod(i, len(calls))  # fresh hashes each lap (the bytes and their crc32 reused):
            await client.put([dataclasses.replace(b, hash=(lap + 1).to_bytes(8, "big") + b.hash[8:])
                              for b in calls[call]])  # every push is stored, evicting older pushes
            moved += per_call * block_bytes
            i += streams
    start = time.monotonic()
    await asyncio.gather(*(stream(k) for k in range(streams)))
    print(json.dumps({"put_gbps": moved / (time.monotonic() - start) / 1e9}))
    await client.close()


def scrape(port: int) -> dict[str, float]:
    """The kvstore's own figures from its /metrics: gets' mean time inside it, puts' wait for gets."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    value = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    get = 'kvmesh:store_transfer_seconds_{}{{op="get"}}'
    return {"served_get_ms": value[get.format("sum")] / max(1.0, value[get.format("count")]) * 1e3,
            "put_wait_s": value.get("kvmesh:store_put_wait_seconds_total", 0.0)}


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def pulls(client: GrpcKVStoreClient, blocks: list[StoredBlock], per_call: int, until: float,
                pause: float = 0.005) -> list[float]:
    """ms of each get of `per_call` held blocks until `until` (monotonic), every block checked."""
    out, i = [], 0
    calls = len(blocks) // per_call
    while time.monotonic() < until:
        want = blocks[(i % calls) * per_call:(i % calls + 1) * per_call]
        t0 = time.perf_counter()
        got = await client.get([b.hash for b in want], "bench", 60.0)  # leased, as a decode pull: never evicted
        out.append((time.perf_counter() - t0) * 1e3)
        if any(g is None or bytes(g.data[:8]) != bytes(w.data[:8]) for g, w in zip(got, want)):
            raise RuntimeError("a pulled block is missing or wrong")
        i += 1
        await asyncio.sleep(pause)
    return out


async def one_setting(yield_s: float, args: argparse.Namespace) -> dict:
    block_bytes = args.block_kib * 1024
    port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    capacity = (8 * args.put_streams + 8) * args.blocks_per_call * block_bytes + 64 * MiB
    pin = ["taskset", "-c", "0"] if args.pin else []  # the kvstore a CPU of its own; the clients share the rest
    proc = subprocess.Popen(pin + [sys.executable, "-m", "kvmesh.kvstore", "--port", str(port), "--device", args.device,
                             "--capacity-bytes", str(capacity), "--block-bytes", str(block_bytes),
                             "--put-yield-seconds", str(yield_s), "--metrics-port", str(metrics_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await wait_serving(address)
        client = GrpcKVStoreClient([address], shared_memory_bytes=64 * MiB)
        held = make_blocks(0, 4 * args.blocks_per_call, block_bytes)
        await client.put(held)
        idle = await pulls(client, held, args.blocks_per_call, time.monotonic() + 1.0)
        pusher = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--push-to", address, "--block-kib", str(args.block_kib),
             "--blocks-per-call", str(args.blocks_per_call), "--put-streams", str(args.put_streams),
             "--seconds", str(args.seconds)], stdout=subprocess.PIPE)
        await asyncio.sleep(1.0)  # the pushes under way (their process starts, blocks made)
        busy = await pulls(client, held, args.blocks_per_call, time.monotonic() + args.seconds - 2.0)
        out, _ = await asyncio.to_thread(pusher.communicate)
        served = scrape(metrics_port)
        if pusher.returncode != 0:
            raise RuntimeError(f"the pushing process failed ({pusher.returncode})")
        await client.close()
        return {"idle": idle, "busy": busy, "put_gbps": json.loads(out.decode().strip().splitlines()[-1])["put_gbps"],
                **served}
    finally:
        proc.terminate()
        proc.wait(10)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--yield-seconds", default="0,0.02", help="kvstore --put-yield-seconds settings, a row each")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs every setting, order alternating")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="where the kvstore pool lives")
    ap.add_argument("--block-kib", type=int, default=103, help="block size in KiB (SmolLM2 INT4: 103)")
    ap.add_argument("--blocks-per-call", type=int, default=64, help="blocks a put or get carries (1,024 tokens)")
    ap.add_argument("--put-streams", type=int, default=4, help="concurrent put streams (prefill workers' pushes)")
    ap.add_argument("--seconds", type=float, default=6.0, help="seconds of pushes a setting")
    ap.add_argument("--pin", action="store_true", help="run the kvstore on CPU 0 and the clients on the others")
    ap.add_argument("--push-to", help=argparse.SUPPRESS)  # the pushing process
    args = ap.parse_args()
    if args.push_to:
        return await push(args.push_to, args.block_kib * 1024, args.blocks_per_call, args.put_streams, args.seconds)
    if args.pin:
        os.sched_setaffinity(0, set(range(1, os.cpu_count())))  # the pushing process inherits it
    settings = [float(s) for s in args.yield_seconds.split(",")]
    runs: dict[float, list[dict]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in (settings if r % 2 == 0 else settings[::-1]):
            runs[s].append(await one_setting(s, args))
    print(f"{'--put-yield-seconds':>19}  {'idle get p50':>12}  {'get under puts p50 / p90 / p99 (ms)':>36}  "
          f"{'gets':>5}  {'in kvstore':>10}  {'put GB/s':>8}  {'puts waited':>11}")
    for s in settings:
        idle = [x for run in runs[s] for x in run["idle"]]
        busy = [x for run in runs[s] for x in run["busy"]]
        gbps = sum(run["put_gbps"] for run in runs[s]) / len(runs[s])
        lat = " / ".join(f"{quantile(busy, q):.1f}" for q in (0.5, 0.9, 0.99))
        inside = sum(run["served_get_ms"] for run in runs[s]) / len(runs[s])
        waited = sum(run["put_wait_s"] for run in runs[s]) / len(runs[s])
        print(f"{s:>19g}  {quantile(idle, 0.5):>12.1f}  {lat:>36}  {len(busy):>5}  {inside:>8.1f}ms  {gbps:>8.2f}"
              f"  {waited:>10.2f}s")
    print(f"({args.rounds} rounds, {args.put_streams} put streams x {args.blocks_per_call} blocks of "
          f"{args.block_kib} KiB, {args.device} pool; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
