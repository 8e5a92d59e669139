"""Child processes of `kvmesh up`: start them, copy their output, wait for their health checks,
notice one that died, stop them in order (SIGTERM, then SIGKILL after a grace period).

Each child runs in its own session so a terminal's Ctrl-C reaches only the launcher, which then stops
them in order; on Linux a child also gets SIGTERM if the launcher itself dies. What to start (the
stack's command lines) is kvmesh.launcher's business; this module only supervises.
"""
from __future__ import annotations

import collections
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Collection, Optional, TextIO


class StackError(RuntimeError):
    """A service failed to start or died; the message names it and quotes its last log lines."""


# ---------------------------------------------------------------------------------------------
# health probes
# ---------------------------------------------------------------------------------------------
def probe(target: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """(healthy, detail) for `host:port` (gRPC health, overall service) or an http:// URL (GET /health)."""
    if target.startswith(("http://", "https://")):
        url = target if target.rstrip("/").count("/") > 2 else target.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                return r.status == 200, f"HTTP {r.status}"
        except Exception as e:  # refused, timeout, HTTP error: all mean "not healthy yet"
            return False, f"{type(e).__name__}: {e}"
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout_s)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, status
    except grpc.RpcError as e:
        return False, f"gRPC {e.code().name}"


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes outgoing connections' local ports from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", taken: Collection[int] = ()) -> int:
    """A port nothing listens on now, for a child to bind later. Chosen below the ephemeral range: a
    port the kernel hands out (bind to 0) can go to any outgoing connection before the child binds it
    (seen: the gateway, started last, lost its port to a worker's connection)."""
    lo, _ = _ephemeral_ports()
    pick = random.SystemRandom()
    for _ in range(100 if lo > 11_000 else 0):
        port = pick.randrange(10_000, lo)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def child_setup():
    """What runs in each child before exec: its own session (a terminal's Ctrl-C reaches only the
    launcher) and, on Linux, SIGTERM when the launcher dies (prctl PR_SET_PDEATHSIG). libc is loaded
    here, before any fork: loading a library between fork and exec can deadlock."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl

    def setup() -> None:
        os.setsid()
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG

    return setup


@dataclass
class ServiceProcess:
    name: str
    """e.g. decode-0"""
    role: str
    argv: list[str]
    health: str
    """What `probe` checks: host:port (gRPC) or http://host:port."""
    popen: Optional[subprocess.Popen] = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    pump: Optional[threading.Thread] = None
    """Copies the child's output into `tail` (and the launcher's log)."""

    @property
    def pid(self) -> Optional[int]:
        return self.popen.pid if self.popen else None

    def returncode(self) -> Optional[int]:
        return self.popen.poll() if self.popen else None

    def last_lines(self) -> str:
        return "\n".join(f"    {line}" for line in self.tail) or "    (no output)"


def answers(target: str, timeout_s: float = 2.0) -> bool:
    """Whether the service at `target` answers its health check at all, whatever it says: alive,
    if not healthy (a gateway with no decode worker up answers 503, and is alive)."""
    if target.startswith(("http://", "https://")):
        url = target if target.rstrip("/").count("/") > 2 else target.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s):
                return True
        except urllib.error.HTTPError:
            return True
        except Exception:  # refused, timeout
            return False
    import grpc

    ok, detail = probe(target, timeout_s)
    return ok or detail not in (f"gRPC {grpc.StatusCode.UNAVAILABLE.name}", f"gRPC {grpc.StatusCode.DEADLINE_EXCEEDED.name}")


class Supervisor:
    """The running children, in spawn order; every line they print goes to their `tail` and `log`."""

    def __init__(self, log: Optional[TextIO] = None) -> None:
        self.log = log
        self.children: list[ServiceProcess] = []
        self._log_lock = threading.Lock()
        self._child_setup = child_setup()
        self._answered: set[int] = set()  # pids that have answered a liveness probe
        self._misses: dict[int, int] = {}  # pid -> liveness probes missed in a row

    def unresponsive(self, misses_allowed: int, timeout_s: float = 2.0) -> Optional[ServiceProcess]:
        """Probes every running child once (`answers`); the first that has answered before and has
        now missed more than `misses_allowed` probes in a row (hung: stopped, deadlocked). A child
        that has not answered yet is starting (loading a model) and is left alone."""
        for c in self.children:
            if c.returncode() is not None:
                continue
            if answers(c.health, timeout_s):
                self._answered.add(c.pid)
                self._misses[c.pid] = 0
            elif c.pid in self._answered:
                self._misses[c.pid] = self._misses.get(c.pid, 0) + 1
                if self._misses[c.pid] > misses_allowed:
                    return c
        return None

    def emit(self, proc: ServiceProcess, line: str) -> None:
        proc.tail.append(line)
        if self.log is not None:
            with self._log_lock:
                self.log.write(f"[{proc.name}] {line}\n")
                self.log.flush()

    def _pump(self, proc: ServiceProcess) -> None:
        assert proc.popen is not None and proc.popen.stdout is not None
        try:
            for raw in proc.popen.stdout:
                self.emit(proc, raw.decode(errors="replace").rstrip("\n"))
        except (ValueError, OSError):  # the pipe was closed under us by stop(): nothing more to read
            pass

    def spawn(self, proc: ServiceProcess) -> None:
        # The launcher passes every setting as a flag; stray KVMESH_* variables must not leak in as defaults.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        env.setdefault("PYTHONUNBUFFERED", "1")
        proc.popen = subprocess.Popen(proc.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, preexec_fn=self._child_setup)
        proc.pump = threading.Thread(target=self._pump, args=(proc,), name=f"log-{proc.name}", daemon=True)
        proc.pump.start()
        self.children.append(proc)

    def respawn(self, dead: ServiceProcess) -> ServiceProcess:
        """A new process for the service of `dead` (same name, command line and health check), in its place."""
        if dead.pump is not None:
            dead.pump.join(2.0)  # its last lines first
        if dead.popen is not None and dead.popen.stdout is not None:
            dead.popen.stdout.close()
        proc = ServiceProcess(dead.name, dead.role, dead.argv, dead.health)
        self.spawn(proc)
        self.children.remove(proc)
        self.children[self.children.index(dead)] = proc
        return proc

    def dead(self) -> Optional[ServiceProcess]:
        """The first child that has exited, if any."""
        return next((c for c in self.children if c.returncode() is not None), None)

    def died_message(self, proc: ServiceProcess) -> str:
        return (f"{proc.name} (pid {proc.pid}) exited with code {proc.returncode()}; "
                f"stopping the other services. Its last output:\n{proc.last_lines()}")

    def wait_healthy(self, wave: list[ServiceProcess], timeout_s: float, abort: threading.Event) -> None:
        """Until every process of `wave` answers its health check; StackError if one dies, `abort` is
        set or `timeout_s` (--startup-timeout) passes."""
        deadline = time.monotonic() + timeout_s
        pending = list(wave)
        while pending:
            if abort.is_set():
                raise StackError("startup interrupted")
            dead = self.dead()
            if dead is not None:
                raise StackError(self.died_message(dead))
            pending = [p for p in pending if not probe(p.health, 1.0)[0]]
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"{p.name} ({p.health}: {probe(p.health, 1.0)[1]})" for p in pending)
                raise StackError(f"not healthy after --startup-timeout {timeout_s:g}s: {names}")
            abort.wait(0.25)

    def stop(self, order: dict[str, int], grace_s: float) -> dict[str, Optional[int]]:
        """SIGTERM the children rank by rank (`order`: role -> rank, lowest first), SIGKILL what
        outlives `grace_s`; their exit codes."""
        for rank in sorted(set(order.values())):
            group = [c for c in self.children if order[c.role] == rank and c.returncode() is None]
            for c in group:
                try:
                    c.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            for c in group:
                try:
                    c.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.emit(c, f"did not stop within {grace_s:g}s of SIGTERM; killing it")
                    c.popen.kill()
                    c.popen.wait()
        codes = {c.name: c.returncode() for c in self.children}
        for c in self.children:
            if c.pump is not None:
                c.pump.join(2.0)  # the last lines (a shutdown error) belong in the log
            if c.popen and c.popen.stdout:
                c.popen.stdout.close()
        return codes

    def kill(self) -> None:
        """SIGKILL every child still running (a second Ctrl-C)."""
        for c in self.children:
            if c.returncode() is None:
                c.popen.kill()
