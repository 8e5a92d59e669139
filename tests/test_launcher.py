"""`kvmesh up`: the whole stack as separate processes with a real redis-server; the official openai client;
SIGINT stops every child. Plus: a child that dies stops the rest with a message naming it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from kvmesh.launcher import Stack, StackConfig, StackError

from test_telemetry import otlp_receiver  # noqa: F401  (fixture: a real OTLP TraceService)

STARTUP_S = 400  # two workers load SmolLM2 on a shared 2-core machine


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:  # field 4 of stat: parent pid
                out.append(int(entry))
    return out


def _environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class _Output:
    """Collects a process's output lines on a thread; `wait_for` a regex with a timeout."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        rx, deadline, seen = re.compile(pattern), time.monotonic() + timeout, 0
        with self.cond:
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-60:]))
                self.cond.wait(left)


@pytest.mark.timeout(STARTUP_S + 300)
def test_kvmesh_up_serves_openai_client_and_sigint_stops_all(redis_flush):
    import openai
    import redis

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_") and k != "OMP_WAIT_POLICY"}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "kvmesh", "up", "--port", "0", "--redis-url", redis_flush,
           "--max-num-seqs", "4", "--kv-cache-memory", "64MiB", "--kvstore-capacity-bytes", str(64 << 20),
           "--startup-timeout", str(STARTUP_S), "--api-key", "test-key"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = _Output(proc)
    try:
        url = out.wait_for(r"kvmesh is up: (http://\S+)/v1", STARTUP_S + 30).group(1)
        children = _children(proc.pid)
        assert len(children) == 4, children  # kvstore, prefill, decode, gateway (Redis replaces the index)
        grandchildren = [g for c in children for g in _children(c)]  # the workers' engine processes
        assert len(grandchildren) >= 2, grandchildren
        # engines sleep when out of work, not spin: several share these cores (kvmesh.cli.environ_for_engines)
        assert all(_environ(g).get("OMP_WAIT_POLICY") == "PASSIVE" for g in grandchildren), grandchildren
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200

        client = openai.OpenAI(base_url=url + "/v1", api_key="test-key", max_retries=0, timeout=300)
        system = ("You are a terse assistant for a hardware store. Answer in one short sentence. "
                  "Never mention prices. Always be polite and precise about tools. ") * 3
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name one tool."}]
        first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
        second = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
        assert first.choices[0].message.content and first.usage.completion_tokens > 0
        assert second.choices[0].message.content == first.choices[0].message.content  # greedy, cached prefix
        assert second.usage.prompt_tokens_details.cached_tokens > 0

        stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                                stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces) == first.choices[0].message.content

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()

        r = redis.Redis.from_url(redis_flush)
        assert r.keys("kvmesh:blk:*"), "the index in Redis holds no blocks"
        r.close()

        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        out.wait_for(r"kvmesh up: stopped \(", 5)
        assert not [c for c in children if _alive(c)]
        deadline = time.monotonic() + 10  # an engine process sees its pipe close; multiprocessing's
        while [g for g in grandchildren if _alive(g)] and time.monotonic() < deadline:  # tracker too
            time.sleep(0.1)
        assert not [g for g in grandchildren if _alive(g)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_dead_child_stops_the_rest_with_a_clear_message():
    cfg = StackConfig(port=0, startup_timeout_s=120, kvstore_capacity_bytes=16 << 20,
                      extra_args=(("decode", ("--lease-seconds", "-1")),))
    stack = Stack(cfg)
    with pytest.raises(StackError) as e:
        stack.start()
    msg = str(e.value)
    assert msg.startswith("decode-0 (pid ") and "exited with code 2" in msg
    assert "--lease-seconds must be positive, got -1.0" in msg
    assert stack.children and all(c.returncode() is not None for c in stack.children)
    assert not [c.pid for c in stack.children if _alive(c.pid)]


@pytest.mark.timeout(STARTUP_S + 200)
def test_stack_in_memory_index_is_shared_across_processes(otlp_receiver):  # noqa: F811
    """Default `kvmesh up` index: one MemoryIndex process. The gateway's lookup (its process) must see
    blocks a decode worker (another process) published: the router predicts cached tokens.
    With --otlp-endpoint, the workers' spans reach a real OTLP receiver under their role's name."""
    import io

    import openai

    receiver, endpoint = otlp_receiver
    log = io.StringIO()
    cfg = StackConfig(port=0, num_prefill=0, startup_timeout_s=STARTUP_S, kvstore_capacity_bytes=64 << 20,
                      otlp_endpoint=endpoint,
                      engine_flags=("--max-num-seqs", "4", "--kv-cache-memory", "64MiB"))
    with Stack(cfg, log=log) as stack:
        assert stack.index_url.startswith("http://127.0.0.1:")
        assert [c.name for c in stack.children] == ["index", "kvstore-0", "decode-0", "gateway"]
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=300)
        messages = [{"role": "system", "content": "Answer briefly and only about cooking. " * 8},
                    {"role": "user", "content": "Boil or fry an egg?"}]
        answers = [client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4,
                                                  temperature=0) for _ in range(2)]
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        predicted = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("kvmesh:router_predicted_hit_tokens_total")]
        assert predicted and predicted[0] >= 16, metrics[:2000]
    codes = {c.name: c.returncode() for c in stack.children}
    assert codes == {"index": 0, "kvstore-0": 0, "decode-0": 0, "gateway": 0}, log.getvalue()[-3000:]
    assert "Traceback" not in log.getvalue(), log.getvalue()[-3000:]
    services = {svc for svc, _span in receiver.spans}
    assert "kvmesh-decode" in services, services  # flushed by each role's tracer shutdown on SIGTERM


def test_sigint_during_startup_stops_what_started():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh", "up", "--port", "0", "--num-prefill", "0",
                             "--kvstore-capacity-bytes", str(16 << 20)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = _Output(proc)
    try:
        out.wait_for(r"^\[kvstore-0\] .*serving", 120)  # first wave up; the decode worker is loading
        children = _children(proc.pid)
        assert len(children) >= 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        out.wait_for(r"interrupted during startup; services stopped", 5)
        assert not [c for c in children if _alive(c)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_restart_starts_a_dead_service_again_until_it_keeps_dying():
    from kvmesh.launcher import RESTARTS_PER_WINDOW
    from kvmesh.supervisor import ServiceProcess

    stack = Stack(StackConfig(port=0, restart=True))
    stack.supervisor.spawn(ServiceProcess("kvstore-0", "kvstore", [sys.executable, "-c", "raise SystemExit(3)"],
                                          "127.0.0.1:9"))

    def next_death():
        deadline = time.monotonic() + 30
        while (dead := stack.dead()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return dead

    pids = set()
    for _ in range(RESTARTS_PER_WINDOW):
        dead = next_death()
        pids.add(dead.pid)
        assert dead.returncode() == 3 and stack.restart(dead)
        assert len(stack.children) == 1 and stack.children[0] is not dead
    dead = next_death()
    assert not stack.restart(dead)  # a crash loop: the stack gives up and stops
    assert len(pids | {dead.pid}) == RESTARTS_PER_WINDOW + 1
    stack.stop()


@pytest.mark.timeout(STARTUP_S + 400)
def test_kvmesh_up_restart_brings_back_a_killed_kvstore_and_decode_worker_and_a_hung_kvstore():
    import openai

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "kvmesh", "up", "--port", "0", "--restart", "--num-prefill", "0",
           "--max-num-seqs", "4", "--kv-cache-memory", "64MiB", "--kvstore-capacity-bytes", str(64 << 20),
           "--startup-timeout", str(STARTUP_S)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = _Output(proc)
    try:
        url = out.wait_for(r"kvmesh is up: (http://\S+)/v1", STARTUP_S + 30).group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        msgs = [{"role": "user", "content": "Name one tool."}]
        ask = lambda: client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=6,  # noqa: E731
                                                     temperature=0).choices[0].message.content
        reference = ask()
        for role in ("kvstore", "decode"):
            before = {c: _cmdline(c) for c in _children(proc.pid)}
            victim = next(c for c, line in before.items() if f" {role} " in line)
            os.kill(victim, signal.SIGKILL)
            out.wait_for(rf"\[{role}-0\] exited with code -9; starting it again \(1 of 5", 30)
            deadline = time.monotonic() + STARTUP_S
            while True:  # the decode worker loads the model again; the gateway finds it up
                try:
                    assert ask() == reference
                    break
                except openai.APIStatusError as e:
                    assert e.status_code == 503 and time.monotonic() < deadline, e
                    time.sleep(1)
            assert proc.poll() is None
            now = {c: _cmdline(c) for c in _children(proc.pid)}
            assert victim not in now and len(now) == len(before)
        # hung (SIGSTOP: it answers nothing and never exits): killed after 20 s of silence, started again
        victim = next(c for c in _children(proc.pid) if " kvstore " in _cmdline(c))
        os.kill(victim, signal.SIGSTOP)
        out.wait_for(r"kvstore-0 \(pid \d+\) answered no health check for 20\+ s; killing it", 60)
        out.wait_for(r"\[kvstore-0\] exited with code -9; starting it again \(2 of 5", 30)
        assert ask() == reference
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return " " + f.read().replace(b"\0", b" ").decode() + " "


def test_liveness_counts_any_answer_and_not_silence():
    import http.server
    import socket

    from kvmesh.supervisor import answers

    class Unhealthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)  # a gateway without a decode worker: alive all the same
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Unhealthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # accepts connections, answers nothing (a stopped process)
    try:
        assert answers(f"http://127.0.0.1:{server.server_port}", 2.0)
        assert not answers(f"http://127.0.0.1:{silent.getsockname()[1]}", 0.5)
        assert not answers(f"127.0.0.1:{silent.getsockname()[1]}", 0.5)
        assert not answers("http://127.0.0.1:9", 0.5)  # nothing listens: refused
    finally:
        server.shutdown()
        silent.close()
