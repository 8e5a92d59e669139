"""ShmArena: a shared-memory segment a kvstore client owns, cut into ranges for its calls in flight.

On one host the block bytes of a put or a get need not cross gRPC: the client writes a put's
blocks into a range of its segment and sends their offsets (`PutShared`), or reserves a range that
the server fills (`GetShared`). A range is freed when its call returns. The segment lives in
/dev/shm under a "kvmesh-" name (the only names a server opens); it is created only when /dev/shm
has twice the room, and every page is written at once (a first write into a page of a full tmpfs
would kill the process with SIGBUS).
"""
from __future__ import annotations

import logging
import os
import secrets
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Optional

log = logging.getLogger(__name__)

PREFIX = "kvmesh-"
ALIGN = 64  # ranges start on cache lines


def shm_free_bytes(path: str = "/dev/shm") -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class ShmArena:
    def __init__(self, shm: SharedMemory) -> None:
        self._shm = shm
        self._free: list[tuple[int, int]] = [(0, shm.size)]  # (start, end), sorted, never adjacent

    @classmethod
    def create(cls, nbytes: int) -> Optional["ShmArena"]:
        """A new segment of `nbytes`, or None (with a warning) where /dev/shm lacks the room."""
        if shm_free_bytes() < 2 * nbytes:  # leave as much again for everyone else
            log.warning("kvstore shared memory off: /dev/shm has %d bytes free, %d wanted twice",
                        shm_free_bytes(), nbytes)
            return None
        shm = SharedMemory(name=f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}", create=True, size=nbytes)
        zeros = bytes(min(nbytes, 1 << 20))
        for start in range(0, nbytes, len(zeros)):  # every page now: later a full /dev/shm cannot SIGBUS us
            n = min(len(zeros), nbytes - start)
            shm.buf[start:start + n] = zeros[:n]
        return cls(shm)

    @property
    def name(self) -> str:
        return self._shm.name.lstrip("/")

    @property
    def size(self) -> int:
        return self._shm.size

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._shm.buf[offset:offset + nbytes]

    def alloc(self, nbytes: int) -> Optional[int]:
        """The offset of a free range of `nbytes` (first fit), or None if none is that large."""
        n = -(-max(1, nbytes) // ALIGN) * ALIGN
        for i, (start, end) in enumerate(self._free):
            if end - start >= n:
                if end - start == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, end)
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Gives back a range `alloc(nbytes)` returned, merged with its free neighbours."""
        start, end = offset, offset + -(-max(1, nbytes) // ALIGN) * ALIGN
        i = 0
        while i < len(self._free) and self._free[i][0] < start:
            i += 1
        if i > 0 and self._free[i - 1][1] == start:  # joins the range before it
            i -= 1
            start = self._free.pop(i)[0]
        if i < len(self._free) and self._free[i][0] == end:  # and the one after it
            end = self._free.pop(i)[1]
        self._free.insert(i, (start, end))

    def close(self) -> None:
        try:
            self._shm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
        try:
            self._shm.unlink()
        except FileNotFoundError:  # removed under us: still tell the resource tracker it is gone
            resource_tracker.unregister(self._shm._name, "shared_memory")  # noqa: SLF001
