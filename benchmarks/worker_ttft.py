"""Prefill-worker TTFT for a long shared prompt: miss vs hit pulled from the kvstore vs local hit.

Real gRPC on loopback, one kvstore node in-process, two prefill workers (the second has never seen
the prompt, so its hit is a kvstore pull). Reports the TTFT of each case and the pull rate.

    .venv/bin/python benchmarks/worker_ttft.py --prompt-len 2048 --kv-cache-dtype fp8
"""
from __future__ import annotations

import argparse
import asyncio
import random
import time

import grpc
import torch

from kvmesh.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.hashing import block_hashes
from kvmesh.index import MemoryIndex
from kvmesh.kvstore.client import GrpcKVStoreClient
from kvmesh.kvstore.config import KVStoreConfig
from kvmesh.kvstore.server import KVStoreServer
from kvmesh.prefill.config import PrefillConfig
from kvmesh.prefill.server import PrefillWorker
from kvmesh.wire import kvmesh_pb2 as pb
from kvmesh.wire import kvmesh_pb2_grpc as pb_grpc


async def prefill_once(stub, prompt: list[int], refs: list[pb.BlockRef], tag: str) -> tuple[float, pb.PrefillReply]:
    start = time.perf_counter()
    reply = await stub.Prefill(pb.PrefillRequest(
        request_id=f"{tag}-{random.random()}", prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=1), cached_blocks=refs))
    return time.perf_counter() - start, reply


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    index = MemoryIndex()
    kvstore = KVStoreServer(KVStoreConfig(port=0, capacity_bytes=args.store_mib << 20), index=index)
    await kvstore.start()
    ecfg = EngineConfig(model=args.model, device="cpu",
                        cache=CacheConfig(kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_mib << 20),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=args.prompt_len + 64,
                                                  max_num_batched_tokens=args.chunk))
    workers, channels, clients = [], [], []
    for _ in range(2):
        client = GrpcKVStoreClient([kvstore.address])
        w = PrefillWorker(PrefillConfig(engine=ecfg, kvstore=(kvstore.address,), port=0),
                          AsyncEngine(await asyncio.to_thread(LLMEngine, ecfg)), client, index)
        await w.start()
        workers.append(w)
        clients.append(client)
        channels.append(grpc.aio.insecure_channel(w.address))
    stubs = [pb_grpc.PrefillStub(c) for c in channels]
    try:
        rng = random.Random(args.seed)
        # Same system prompt, a different 8-token user turn each time (the tail is never cached).
        system = [rng.randrange(100, 49000) for _ in range(args.prompt_len - 8)]
        prompt = lambda: system + [rng.randrange(100, 49000) for _ in range(8)]  # noqa: E731
        ctx = workers[0].runtime.engine.info.hash_context()
        await prefill_once(stubs[0], prompt()[:64], [], "warmup")
        await prefill_once(stubs[1], prompt()[:64], [], "warmup")
        miss, _ = await prefill_once(stubs[0], prompt(), [], "miss")  # computes and puts every block
        p = prompt()
        refs = [pb.BlockRef(hash=h, node=kvstore.address) for h in block_hashes(p, ctx)]
        remote, r_remote = await prefill_once(stubs[1], p, refs, "remote")
        local, r_local = await prefill_once(stubs[1], prompt(), refs, "local")
        reg = workers[1].runtime.metrics.registry
        pulled_bytes = reg.get_sample_value("kvmesh:worker_transfer_bytes_total", {"op": "pull"}) or 0.0
        pull_s = reg.get_sample_value("kvmesh:worker_transfer_seconds_sum", {"op": "pull"}) or 0.0
        layout = workers[0].runtime.engine.info.layout
        print(f"prompt {args.prompt_len} tokens, kv {layout.kv_dtype}, block {layout.block_bytes} B, "
              f"threads {args.threads}")
        print(f"miss                 TTFT {miss:7.3f} s")
        print(f"hit via kvstore pull TTFT {remote:7.3f} s  ({remote / miss:.1%} of miss, "
              f"{r_remote.num_cached_tokens} cached tokens)")
        print(f"hit in local cache   TTFT {local:7.3f} s  ({local / miss:.1%} of miss, "
              f"{r_local.num_cached_tokens} cached tokens)")
        if pull_s:
            print(f"pull (get + import + release): {pulled_bytes / 1e6:.1f} MB in {pull_s:.3f} s = "
                  f"{pulled_bytes / pull_s / 1e9:.2f} GB/s")
    finally:
        for c in channels:
            await c.close()
        for w in workers:
            await w.stop(grace=0.5)
        for c in clients:
            await c.close()
        await kvstore.stop(grace=0.5)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kv-mib", type=int, default=256, help="each worker's KV pool (MiB)")
    ap.add_argument("--store-mib", type=int, default=512, help="kvstore pool (MiB)")
    ap.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(main(ap.parse_args()))
