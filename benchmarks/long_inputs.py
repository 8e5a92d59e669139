"""Megabyte inputs at the gateway: how long each request takes and the longest stall of the gateway's
event loop meanwhile (every other stream waits that long), a row per input, in one run.

    .venv/bin/python benchmarks/long_inputs.py [--mb 60] [--max-model-len 2048] [--flood 8]
    .venv/bin/python benchmarks/long_inputs.py --concurrent 8   (memory alone: its own process)

The gateway app in this process (SmolLM2's tokenizer, no workers: every row is refused or answered
by the gateway itself) and a ticker task on its loop; the clients are threads (urllib, whose
socket calls let the GIL go: an aiohttp client on the same loop showed its own 52 MB write as a
stall of the gateway's loop); inputs: a text prompt and a chat message of
--mb megabytes, a token-id prompt and a /detokenize list of ~--mb megabytes of JSON, a /tokenize
text of a tenth of it (with and without its token strings), and a chat of ~--mb megabytes of
one-letter messages. Then a flood: --flood clients each tokenizing a tenth of --mb megabytes at once,
and how long a /tokenize of a prompt that fits the context (40k characters) waits meanwhile.
--concurrent N: instead, N clients send the one-letter chat at once; the process's peak RSS.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from aiohttp.test_utils import TestServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from loop_gaps import LoopGaps  # noqa: E402

from kvmesh.gateway.app import build_app  # noqa: E402
from kvmesh.gateway.config import GatewayConfig  # noqa: E402
from kvmesh.index import MemoryIndex  # noqa: E402
from kvmesh.model.config import model_identity  # noqa: E402
from kvmesh.model.tokenizer import Tokenizer  # noqa: E402


def inputs(mb: int) -> list[tuple[str, str, dict]]:
    words = "word " * (mb * 200_000)
    ids = [100 + (i * 7919) % 40000 for i in range(mb * 130_000)]  # ~7.7 bytes of JSON an id
    return [("text prompt", "/v1/completions", {"model": "smollm2", "prompt": words, "max_tokens": 4}),
            ("chat message", "/v1/chat/completions",
             {"model": "smollm2", "messages": [{"role": "user", "content": words}], "max_tokens": 4}),
            ("token-id prompt", "/v1/completions", {"model": "smollm2", "prompt": ids, "max_tokens": 4}),
            ("/detokenize", "/detokenize", {"model": "smollm2", "tokens": ids}),
            ("/tokenize, a tenth", "/tokenize", {"model": "smollm2", "prompt": words[: len(words) // 10]}),
            ("/tokenize, a tenth, token strs", "/tokenize",
             {"model": "smollm2", "prompt": words[: len(words) // 10], "return_token_strs": True}),
            ("chat of one-letter messages", "/v1/chat/completions",
             {"model": "smollm2", "messages": [{"role": "user", "content": "x"}] * (mb * 30_000), "max_tokens": 4})]


class Client:
    """HTTP posts to the gateway from threads of their own."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.threads = ThreadPoolExecutor(32, thread_name_prefix="client")

    def _post(self, path: str, raw: bytes) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, data=raw, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    async def post(self, path: str, raw: bytes) -> tuple[int, bytes]:
        return await asyncio.get_running_loop().run_in_executor(self.threads, self._post, path, raw)


async def main(args: argparse.Namespace) -> None:
    tok = Tokenizer.from_model("smollm2")
    app = build_app(GatewayConfig(decode=("127.0.0.1:9",), max_model_len=args.max_model_len), tokenizer=tok,
                    index=MemoryIndex(), model_id=model_identity("smollm2"), health_checks=False)
    server = TestServer(app, client_max_size=128 << 20)
    await server.start_server()
    client = Client(f"http://127.0.0.1:{server.port}")
    try:
        if args.concurrent:
            return await concurrent(client, args)
        print(f"| input | body MB | status | seconds | longest loop stall s |\n|---|---|---|---|---|")
        for name, path, body in inputs(args.mb):
            raw = json.dumps(body).encode()
            async with LoopGaps() as loop:
                status, _ = await client.post(path, raw)
            print(f"| {name} | {len(raw) / 1e6:.0f} | {status} | {loop.seconds:.2f} | {loop.longest:.2f} |", flush=True)
        if args.flood:
            await flood(client, args)
    finally:
        await server.close()
        client.threads.shutdown()


async def concurrent(client: Client, args: argparse.Namespace) -> None:
    """--concurrent clients each sending the chat of one-letter messages; the peak RSS it cost."""
    name, path, body = inputs(args.mb)[-1]
    raw = json.dumps(body).encode()
    del body
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # GB (Linux: KB)
    rs = await asyncio.gather(*[client.post(path, raw) for _ in range(args.concurrent)])
    print(f"| {args.concurrent} x {name} | body MB | statuses | peak RSS GB (before) |\n|---|---|---|---|\n"
          f"| | {len(raw) / 1e6:.0f} | {sorted(set(status for status, _ in rs))} | "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} ({before:.2f}) |")


async def flood(client: Client, args: argparse.Namespace) -> None:
    """--flood clients tokenizing a tenth of --mb MB each, and a fitting prompt's /tokenize among them."""
    big = json.dumps({"model": "smollm2", "prompt": "word " * (args.mb * 20_000)}).encode()
    fits = json.dumps({"model": "smollm2", "prompt": "fits " * 8_000}).encode()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    posts = [asyncio.create_task(client.post("/tokenize", big)) for _ in range(args.flood)]
    await asyncio.sleep(0.5)
    t1 = loop.time()
    status, _ = await client.post("/tokenize", fits)
    waited = loop.time() - t1
    await asyncio.gather(*posts)
    print(f"\n| flood | body MB each | fitting /tokenize status | it waited s | flood s |\n|---|---|---|---|---|\n"
          f"| {args.flood} clients | {len(big) / 1e6:.0f} | {status} | {waited:.2f} | {loop.time() - t0:.2f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=60)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--flood", type=int, default=8, help="clients tokenizing megabytes at once (0: none)")
    ap.add_argument("--concurrent", type=int, default=0, help="only: clients sending a big chat at once, peak RSS")
    asyncio.run(main(ap.parse_args()))
