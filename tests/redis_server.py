"""A real redis-server for tests and benchmarks: started on a free port, stopped afterwards.

    with RedisServer() as r:   # r.url == "redis://127.0.0.1:PORT/0"
        ...
        r.crash(); r.start(port=r.port)   # an outage: killed, then back empty on the same port
"""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, executable: str | None = None) -> None:
        exe = executable or shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.executable = exe
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0, port: int = 0) -> "RedisServer":
        """On `port`, or a free one."""
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="kvmesh-redis-")
        for _ in range(1 if port else 3):  # another process may grab the free port between probe and bind
            self.port = port or free_port()
            self._proc = subprocess.Popen(
                [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", self._dir.name],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(timeout):
                return self
            self._kill()
        raise RuntimeError(f"redis-server did not start (last port {self.port})")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)  # a frozen server cannot act on SIGTERM
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def crash(self) -> None:
        """SIGKILL: gone at once, its data with it (nothing is saved)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def freeze(self) -> None:
        """SIGSTOP: connections still open (the kernel accepts them) but nothing answers, as in a partition."""
        self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self._kill()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
