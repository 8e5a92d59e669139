"""PageChannel: small messages pickled, a message's pages raw after it, between real processes over
a socket pair; the payload is read whole, also while another thread of the reader holds the GIL."""
from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from kvmesh.engine.page_channel import PageChannel


def _sender(conn, payloads: list[bytes]) -> None:
    ch = PageChannel(conn)
    for i, p in enumerate(payloads):
        ch.send(("export", i), p)
        ch.send(("note", i))  # a message without a payload between them
    ch.close()


def _spin(stop: threading.Event) -> None:
    """Pure Python until told to stop: holds the GIL as a busy event loop does."""
    n = 0
    while not stop.is_set():
        n += 1


def test_messages_and_raw_payloads_cross_in_order():
    payloads = [os.urandom(n) for n in (0, 1, 65_537, 6_600_000, 3)]
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_sender, args=(theirs, payloads))
    proc.start()
    theirs.close()
    ch = PageChannel(mine)
    stop = threading.Event()
    busy = threading.Thread(target=_spin, args=(stop,))
    busy.start()
    try:
        for i, p in enumerate(payloads):
            kind, n, nbytes = ch.recv()
            assert (kind, n, nbytes) == ("export", i, len(p))
            assert ch.recv_payload(nbytes) == p
            assert ch.recv() == ("note", i)
        proc.join(30)
        with pytest.raises(EOFError):
            ch.recv()
    finally:
        stop.set()
        busy.join()
        ch.close()


def test_a_payload_cut_short_raises_eof():
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=True)
    sender = PageChannel(theirs)
    sender.conn.send(("export", 0, 1000))
    sender._sock.sendall(b"x" * 10)
    sender.close()
    ch = PageChannel(mine)
    try:
        assert ch.recv() == ("export", 0, 1000)
        with pytest.raises(EOFError, match="inside a payload"):
            ch.recv_payload(1000)
    finally:
        ch.close()
