"""Gateway routing decisions per second for 4,096-token prompts: MemoryIndex, RedisIndex, RemoteIndex.

One decision = what the gateway does per request before it calls a worker: chained block hashes of
the prompt (256 blocks of 16), ONE index lookup for every block, and the router's cost choice.
Half of the prompts are cached (their leading blocks held by a kvstore node and a decode worker), so
lookups return real holder sets. Redis is a real redis-server started here on a free port; "remote"
is `kvmesh index` (one MemoryIndex served over HTTP, what `kvmesh up` uses without --redis-url) in
its own process.

    .venv/bin/python benchmarks/router.py [--prompts 64] [--seconds 3] [--concurrency 1 16]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import time
import urllib.request

import uvloop

from kvmesh.gateway.router import Router
from kvmesh.hashing import HashContext, block_hashes
from kvmesh.index import MemoryIndex, RedisIndex
from kvmesh.remote_index import RemoteIndex

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from redis_server import RedisServer, free_port  # noqa: E402  (the tests' real redis-server launcher)

BLOCK = 16
PREFILL = ["10.0.0.1:50071", "10.0.0.2:50071"]
DECODE = ["10.0.1.1:50081", "10.0.1.2:50081", "10.0.1.3:50081", "10.0.1.4:50081"]
STORES = ["10.0.2.1:50061", "10.0.2.2:50061"]


def make_prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(49152) for _ in range(tokens)] for _ in range(n)]


async def populate(index, prompts: list[list[int]], ctx: HashContext, rng: random.Random) -> None:
    for i, p in enumerate(prompts):
        if i % 2:
            continue  # odd prompts stay cold
        hashes = block_hashes(p, ctx)
        cut = rng.randrange(len(hashes) // 2, len(hashes) + 1)
        await index.publish(STORES[i % len(STORES)], hashes[:cut], [])
        await index.publish(DECODE[i % len(DECODE)], hashes[:cut // 2], [])


async def decide(index, router: Router, ctx: HashContext, prompt: list[int], t: list[float]) -> None:
    t0 = time.perf_counter()
    hashes = block_hashes(prompt, ctx)
    t1 = time.perf_counter()
    holders = await index.lookup(hashes)
    t2 = time.perf_counter()
    router.route(len(prompt), hashes, holders)
    t3 = time.perf_counter()
    t[0] += t1 - t0
    t[1] += t2 - t1
    t[2] += t3 - t2


async def measure(index, prompts: list[list[int]], ctx: HashContext, seconds: float,
                  concurrency: int) -> dict:
    router = Router(PREFILL, DECODE, block_size=BLOCK, rng=random.Random(0))
    parts = [0.0, 0.0, 0.0]
    count = 0
    stop = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        nonlocal count
        i = k
        while time.perf_counter() < stop:
            await decide(index, router, ctx, prompts[i % len(prompts)], parts)
            count += 1
            i += concurrency

    for p in prompts[:4]:  # warm connections and caches
        await decide(index, router, ctx, p, [0.0, 0.0, 0.0])
    t0 = time.perf_counter()
    await asyncio.gather(*(loop(k) for k in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"per_s": count / wall, "hash_us": parts[0] / count * 1e6, "lookup_us": parts[1] / count * 1e6,
            "route_us": parts[2] / count * 1e6, "n": count}


@contextlib.contextmanager
def index_process():
    """`kvmesh index` on a free port; yields its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh", "index", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("kvmesh index did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


async def main_async(args) -> None:
    ctx = HashContext("smollm2-bench", "fp8_e4m3", BLOCK)
    prompts = make_prompts(args.prompts, args.tokens, seed=1)
    rows = []
    with RedisServer() as redis, index_process() as remote_url:
        for name, make in (("memory", MemoryIndex), ("redis", lambda: RedisIndex(redis.url, namespace="bench")),
                           ("remote", lambda: RemoteIndex(remote_url))):
            index = make()
            await populate(index, prompts, ctx, random.Random(2))
            for c in args.concurrency:
                rows.append((name, c, await measure(index, prompts, ctx, args.seconds, c)))
            await index.close()
    print(f"routing decisions, {args.tokens}-token prompts ({args.tokens // BLOCK} blocks), "
          f"{len(PREFILL)} prefill + {len(DECODE)} decode workers, {args.seconds:g} s per row")
    print(f"| index  | concurrency | decisions/s | hash µs | lookup µs | route µs |")
    print(f"|--------|------------:|------------:|--------:|----------:|---------:|")
    for name, c, r in rows:
        print(f"| {name:<6} | {c:>11} | {r['per_s']:>11.0f} | {r['hash_us']:>7.0f} | {r['lookup_us']:>9.0f} "
              f"| {r['route_us']:>8.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    uvloop.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
