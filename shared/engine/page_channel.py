"""PageChannel: one end of a socket pair between a worker and its engine process, on which small
messages travel pickled (a multiprocessing `Connection`) and a message's pages follow it raw.

Why raw, and why a socket: a reader thread in the worker competes for the GIL with the worker's
busy event loop, and every read that returns costs it a wait for the GIL, up to the 5 ms switch
interval. `Connection.recv_bytes` on a pipe returns every 64 KiB (the pipe's capacity): ~100 GIL
waits a 6.6 MB export, ~530 ms against a spinning thread on the build machine. One `recv_into`
with MSG_WAITALL waits in the kernel for the whole payload and takes the GIL once: ~11 ms
(docs/benchmarks.md, "Thirty-fourth session"). The sender's `sendall` is one call too.
"""
from __future__ import annotations

import os
import socket
from multiprocessing.connection import Connection
from typing import Optional


class PageChannel:
    def __init__(self, conn: Connection) -> None:
        """`conn`: one end of `Pipe(duplex=True)` (a socket pair), the other end a PageChannel too."""
        self.conn = conn
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))

    def send(self, msg: tuple, payload: Optional[memoryview | bytes] = None) -> None:
        """Sends `msg`; with a payload, `msg + (len(payload),)` and then the payload's bytes raw."""
        if payload is None:
            self.conn.send(msg)
            return
        payload = memoryview(payload).cast("B")
        self.conn.send(msg + (payload.nbytes,))
        self._sock.sendall(payload)

    def recv(self) -> tuple:
        return self.conn.recv()

    def recv_payload(self, nbytes: int) -> bytearray:
        """The `nbytes` raw bytes that follow a message sent with a payload (EOFError if the other
        end closes first)."""
        buf = bytearray(nbytes)
        view = memoryview(buf)
        got = 0
        while got < nbytes:  # one call unless a signal interrupts it
            n = self._sock.recv_into(view[got:], nbytes - got, socket.MSG_WAITALL)
            if n == 0:
                raise EOFError("the other end closed inside a payload")
            got += n
        return buf

    def close(self) -> None:
        self._sock.close()
        self.conn.close()
