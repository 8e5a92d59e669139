"""A soak of the served stack: concurrent clients through the gateway's OpenAI API for a while, a
seeded mix of well-formed requests, requests their clients abandon, and fuzzed ones; then what must
hold once the load is gone.

    report = await run_soak(url, model, SoakConfig(seconds=30, clients=6))
    problems = report.problems + await check_quiet(probes)   # empty when the stack held

Well-formed requests go through the official `openai` client (chat, streamed or not, greedy or
seeded sampling, stop strings) or raw HTTP (completions with n and logprobs); each must answer 200
with exactly the tokens asked for (ignore_eos) or fewer with a stop. Abandoned ones close their
connection mid-stream or give up on a non-streamed answer. Fuzzed ones mutate a well-formed body
(wrong types, values out of range, missing or unknown fields, broken JSON): each must get a 4xx with
an OpenAI-shaped error, or a well-formed 200; never a 5xx or a dropped connection. Afterwards
(`check_quiet`): no request running or waiting anywhere, every KV page and kvstore lease given
back, and a greedy request answers as it did before the load. Used by tests/test_soak.py (short)
and benchmarks/soak.py (long, with a table).
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import aiohttp

WORDS = ("tool hammer saw drill screw nail board paint brush ladder glue tape level wrench bolt nut "
         "garden hose rake shovel seed light bulb wire switch pipe valve filter brick tile").split()
KINDS = {  # kind: weight
    "chat": 4, "chat_stream": 4, "chat_stop": 1, "completion_n": 2,
    "abandon_stream": 2, "abandon_wait": 1, "fuzz": 5, "too_long": 1,
}
BAD_VALUES = (None, "x", "", -1, 0, 1.5, 10 ** 9, 2 ** 70, -2 ** 70, True, [], {}, [1, "a"], {"a": {"b": []}},
              "\ud800", float("nan"))
FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop", "seed", "logprobs",
          "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "ignore_eos", "stream_options", "response_format", "tools", "tool_choice", "user", "min_tokens",
          "max_completion_tokens", "echo", "best_of", "suffix")


@dataclass(frozen=True)
class SoakConfig:
    seconds: float = 30.0
    """how long clients keep sending"""
    clients: int = 6
    """concurrent clients"""
    seed: int = 0
    max_tokens: int = 12
    """the most a well-formed request asks for (each draws 1..max_tokens)"""
    max_model_len: int = 512
    """the stack's --max-model-len (too_long requests pass it)"""
    request_timeout_s: float = 180.0


@dataclass
class SoakReport:
    counts: Counter = field(default_factory=Counter)  # (kind, outcome) -> requests
    latencies: dict = field(default_factory=lambda: defaultdict(list))  # kind -> seconds of each answered one
    problems: list = field(default_factory=list)  # what broke a rule, one line each
    seconds: float = 0.0

    def problem(self, kind: str, what: str) -> None:
        self.counts[(kind, "PROBLEM")] += 1
        if len(self.problems) < 50:
            self.problems.append(f"{kind}: {what}")


class _Client:
    """One client's requests, drawn from its own seeded stream."""

    def __init__(self, url: str, model: str, cfg: SoakConfig, rng: random.Random, session: aiohttp.ClientSession,
                 openai_client, report: SoakReport) -> None:
        self.url, self.model, self.cfg, self.rng = url, model, cfg, rng
        self.session, self.oa, self.report = session, openai_client, report
        self.systems = [self.words(60 + 20 * i) for i in range(3)]  # shared prefixes: kvstore and cache hits

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": self.rng.choice(self.systems)},
                {"role": "user", "content": self.words(self.rng.randint(3, 30)) + "?"}]

    async def run(self, deadline: float) -> None:
        kinds, weights = zip(*KINDS.items())
        while time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            start = time.monotonic()
            try:
                outcome = await asyncio.wait_for(getattr(self, kind)(), self.cfg.request_timeout_s)
            except Exception as exc:  # a well-formed request that failed, a dropped connection, a timeout
                self.report.problem(kind, f"{type(exc).__name__}: {str(exc)[:300]}")
                continue
            if outcome is not None:
                self.report.counts[(kind, outcome)] += 1
                self.report.latencies[kind].append(time.monotonic() - start)

    # -- well-formed --------------------------------------------------------------------------
    def sampling(self) -> dict:
        if self.rng.random() < 0.5:
            return {"temperature": 0}
        return {"temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(1 << 30)}

    async def chat(self) -> str:
        k = self.rng.randint(1, self.cfg.max_tokens)
        r = await self.oa.chat.completions.create(model=self.model, messages=self.messages(), max_tokens=k,
                                                  extra_body={"ignore_eos": True}, **self.sampling())
        self.expect(r.usage.completion_tokens == k and r.choices[0].finish_reason == "length",
                    f"asked {k} tokens, got {r.usage.completion_tokens} ({r.choices[0].finish_reason})")
        return "ok"

    async def chat_stream(self) -> str:
        k = self.rng.randint(1, self.cfg.max_tokens)
        stream = await self.oa.chat.completions.create(
            model=self.model, messages=self.messages(), max_tokens=k, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **self.sampling())
        usage, finish = None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                finish = c.finish_reason or finish
        self.expect(usage is not None and usage.completion_tokens == k and finish == "length",
                    f"asked {k} tokens, got {usage and usage.completion_tokens} ({finish})")
        return "ok"

    async def chat_stop(self) -> str:
        k = self.rng.randint(1, self.cfg.max_tokens)
        r = await self.oa.chat.completions.create(model=self.model, messages=self.messages(), max_tokens=k,
                                                  stop=[self.rng.choice(WORDS), "."], temperature=0)
        c = r.choices[0]
        self.expect(r.usage.completion_tokens <= k and c.finish_reason in ("stop", "length"),
                    f"asked at most {k} tokens, got {r.usage.completion_tokens} ({c.finish_reason})")
        return c.finish_reason

    async def completion_n(self) -> str:
        k, n = self.rng.randint(1, self.cfg.max_tokens), self.rng.randint(2, 3)
        body = {"model": self.model, "prompt": self.words(self.rng.randint(5, 80)), "max_tokens": k, "n": n,
                "logprobs": 2, "ignore_eos": True, "temperature": 0.7, "seed": self.rng.randrange(1 << 30)}
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            got = await r.json()
        self.expect(r.status == 200, f"HTTP {r.status}: {str(got)[:200]}")
        choices = sorted(got["choices"], key=lambda c: c["index"])
        self.expect([c["index"] for c in choices] == list(range(n)) and got["usage"]["completion_tokens"] == n * k
                    and all(len(c["logprobs"]["tokens"]) == k for c in choices),
                    f"n={n} x {k} tokens: {str(got)[:300]}")
        return "ok"

    async def too_long(self) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": self.words(self.cfg.max_model_len + 50)}],
                "max_tokens": 4}
        async with self.session.post(self.url + "/v1/chat/completions", json=body) as r:
            got = await r.json(content_type=None)
        self.expect(r.status == 400 and _openai_error(got), f"HTTP {r.status}: {str(got)[:200]}")
        return "400"

    # -- abandoned ----------------------------------------------------------------------------
    async def abandon_stream(self) -> str:
        body = {"model": self.model, "messages": self.messages(), "max_tokens": 200, "ignore_eos": True,
                "stream": True, "temperature": 0}
        keep = self.rng.randint(0, 3)  # data events read before hanging up
        async with self.session.post(self.url + "/v1/chat/completions", json=body) as r:
            self.expect(r.status == 200, f"HTTP {r.status}")
            seen = 0
            async for line in r.content:
                if line.startswith(b"data:"):
                    seen += 1
                    if seen > keep:
                        break
            r.close()  # drops the connection: the gateway must abort the request on its worker
        return "closed"

    async def abandon_wait(self) -> str:
        body = {"model": self.model, "prompt": self.words(40), "max_tokens": 200, "ignore_eos": True}

        async def ask() -> None:
            async with self.session.post(self.url + "/v1/completions", json=body) as r:
                await r.read()
        try:
            await asyncio.wait_for(ask(), self.rng.uniform(0.05, 1.0))
            return "finished"  # answered before the client gave up (a fast machine)
        except asyncio.TimeoutError:
            return "gave up"

    # -- fuzzed -------------------------------------------------------------------------------
    def fuzzed(self) -> tuple[str, str, bytes]:
        """(method, path, body): a well-formed body of one of the POST routes, mutated."""
        path = self.rng.choices(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"],
                                [5, 3, 1, 1])[0]
        chat = path == "/v1/chat/completions" or (path == "/tokenize" and self.rng.random() < 0.5)
        body: dict = {"model": self.model}
        if path == "/detokenize":
            body["tokens"] = [self.rng.randrange(1000) for _ in range(self.rng.randint(0, 8))]
        elif chat:
            body["messages"] = self.messages()
        else:
            body["prompt"] = self.words(10)
        if path.startswith("/v1/"):
            body["max_tokens"] = self.rng.randint(1, 4)
        for _ in range(self.rng.randint(1, 3)):
            r = self.rng.random()
            if r < 0.45:
                body[self.rng.choice(FIELDS)] = self.rng.choice(BAD_VALUES)
            elif r < 0.6:
                body.pop(self.rng.choice(["model", "messages", "prompt", "max_tokens", "tokens"]), None)
            elif r < 0.7 and "tokens" in body:
                body["tokens"] = body["tokens"] + [self.rng.choice(BAD_VALUES + (-1, 49151, 49152, 10 ** 12))]
            elif r < 0.8 and isinstance(body.get("messages"), list) and body["messages"]:
                m = dict(self.rng.choice(body["messages"]))
                key = self.rng.choice(["role", "content", "name", "tool_calls"])
                m[key] = self.rng.choice(BAD_VALUES + ("robot", "tool", [{"type": "text", "text": "hi"}],
                                                       [{"type": "image_url"}]))
                body["messages"] = body["messages"] + [m]
            else:
                body[self.words(1) + "_x"] = self.rng.choice(BAD_VALUES)  # a field nobody knows
        for name in ("max_tokens", "max_completion_tokens", "min_tokens"):  # a well-formed 200 would run to
            value = body.get(name)                                           # the model's length: too long here
            if isinstance(value, int) and not isinstance(value, bool) and value > 64:
                body[name] = 4
        if path.startswith("/v1/") and not {"max_tokens", "max_completion_tokens"} & body.keys():
            body.setdefault("stop", [" ", "e"])  # no length asked: ends at once, not at the model's length
        raw = json.dumps(body, allow_nan=True).encode()
        cut = self.rng.random()
        if cut < 0.08:
            raw = raw[:self.rng.randrange(len(raw))]  # truncated JSON
        elif cut < 0.12:
            raw = raw.replace(b'"', b"\xff", 1)  # not UTF-8
        elif cut < 0.15:
            raw = self.rng.choice([b"[]", b"null", b"1", b'"a"', b"[" * 5000 + b"]" * 5000, b"",
                                   b'{"max_tokens": ' + b"9" * 5000 + b"}"])  # int over 4,300 digits
        method = "POST" if self.rng.random() > 0.03 else self.rng.choice(["GET", "PUT", "DELETE"])
        return method, path, raw

    async def fuzz(self) -> str:
        method, path, raw = self.fuzzed()
        async with self.session.request(method, self.url + path, data=raw,
                                        headers={"Content-Type": "application/json"}) as r:
            text = await r.read()
            status = r.status
        try:
            got = json.loads(text) if not text.startswith(b"data:") else None
        except ValueError:
            got = "not JSON"
        if status >= 500 or status < 200:
            self.report.problem("fuzz", f"HTTP {status} for {method} {path} {raw[:300]!r}: {text[:300]!r}")
            return None
        if status >= 400:
            self.expect(_openai_error(got), f"HTTP {status} without an OpenAI error for {method} {path} "
                        f"{raw[:200]!r}: {text[:200]!r}")
            return str(status)
        ok = text.startswith(b"data:") and text.rstrip().endswith(b"data: [DONE]") or (
            isinstance(got, dict) and any(isinstance(got.get(k), t) for k, t in (
                ("choices", list), ("tokens", list), ("prompt", str))))  # completions, /tokenize, /detokenize
        self.expect(ok, f"HTTP 200 with a malformed answer for {raw[:200]!r}: {text[:200]!r}")
        return "200"

    @staticmethod
    def expect(cond: bool, what: str) -> None:
        if not cond:
            raise AssertionError(what)


def _openai_error(got) -> bool:
    err = got.get("error") if isinstance(got, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"] != ""
            and isinstance(err.get("type"), str) and "param" in err and "code" in err)


async def run_soak(url: str, model: str, cfg: SoakConfig, api_key: str = "none") -> SoakReport:
    """`cfg.clients` clients send requests for `cfg.seconds` to the gateway at `url`."""
    import openai

    report = SoakReport()
    oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=cfg.request_timeout_s)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s),
                                     headers={"Authorization": f"Bearer {api_key}"}) as session:
        start = time.monotonic()
        deadline = start + cfg.seconds
        clients = [_Client(url, model, cfg, random.Random(cfg.seed * 1000 + i), session, oa, report)
                   for i in range(cfg.clients)]
        await asyncio.gather(*(c.run(deadline) for c in clients))
        report.seconds = time.monotonic() - start
    await oa.close()
    return report


# -- after the load ---------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^(kvmesh:[a-z_]+)(\{[^}]*\})?\s+([-0-9.e+naif]+)$", re.M)


async def metric_sums(session: aiohttp.ClientSession, metrics_url: str) -> dict[str, float]:
    """Each metric's samples summed over its labels, from a /metrics page."""
    async with session.get(metrics_url) as r:
        text = await r.text()
    sums: dict[str, float] = defaultdict(float)
    for name, _, value in _SAMPLE.findall(text):
        sums[name] += float(value)
    return sums


@dataclass(frozen=True)
class QuietProbes:
    """Where to look once the load is gone."""

    gateway_metrics: str
    worker_metrics: tuple[str, ...]
    kvstores: tuple[str, ...]


async def check_quiet(probes: QuietProbes, timeout_s: float = 60.0) -> list[str]:
    """Waits (up to `timeout_s`) for every request to end everywhere; what is still held then."""
    from kvmesh.kvstore.client import GrpcKVStoreClient

    kv = GrpcKVStoreClient(list(probes.kvstores))
    deadline = time.monotonic() + timeout_s
    try:
        async with aiohttp.ClientSession() as session:
            while True:
                held = []
                for url in (probes.gateway_metrics, *probes.worker_metrics):
                    m = await metric_sums(session, url)
                    for name in ("kvmesh:num_requests_running", "kvmesh:num_requests_waiting",
                                 "kvmesh:kv_cache_usage_perc"):
                        if m.get(name, 0.0) != 0.0:
                            held.append(f"{url}: {name} = {m[name]}")
                for node, stats in (await kv.stats()).items():
                    if stats.blocks_leased:
                        held.append(f"kvstore {node}: {stats.blocks_leased} blocks still leased")
                if not held or time.monotonic() > deadline:
                    return held
                await asyncio.sleep(0.5)
    finally:
        await kv.close()


async def greedy_answer(url: str, model: str, api_key: str = "none") -> str:
    """One greedy chat answer alone (the same before and after the load: no state went bad)."""
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=300) as oa:
        r = await oa.chat.completions.create(
            model=model, temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": "Name three tools for a hardware store, briefly."}])
    return r.choices[0].message.content


def table(report: SoakReport) -> str:
    """One row a kind: outcomes and latency p50 / p99."""
    rows = ["| kind | requests | outcomes | p50 / p99 s |", "|---|---|---|---|"]
    for kind in KINDS:
        outcomes = {o: n for (k, o), n in sorted(report.counts.items()) if k == kind}
        lat = sorted(report.latencies.get(kind, []))
        q = (lambda p: lat[min(len(lat) - 1, int(p * (len(lat) - 1) + 0.5))]) if lat else None
        rows.append(f"| {kind} | {sum(outcomes.values())} | "
                    + ", ".join(f"{o} {n}" for o, n in outcomes.items())
                    + (f" | {q(0.5):.2f} / {q(0.99):.2f} |" if q else " | - |"))
    return "\n".join(rows)
