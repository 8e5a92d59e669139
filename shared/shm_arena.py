"""ShmArena: a shared-memory segment its creator cuts into ranges for the transfers in flight.

On one host, page bytes need not cross a socket or a pipe: they are written into a range of a
segment both processes map, and only the range's offset travels. Two users:
- a kvstore client writes a put's blocks into its segment and sends their offsets (`PutShared`),
  or reserves a range that the server fills (`GetShared`); a range is freed when its call returns;
- a worker and its engine process (`engine/engine_process.py`): the engine lands each finished
  request's exported pages in one segment and the worker writes imported pages into another, or
  has the kvstore write them there (`SegmentRange`).
A segment lives in /dev/shm under a "kvmesh-" name (the only names a kvstore server opens); it is
created only when /dev/shm has twice the room, and every page is written at once (a first write
into a page of a full tmpfs would kill the process with SIGBUS). `RangeAllocator` is the free list
alone, for a process that maps a segment someone else created (`MappedSegment`).
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SegmentRange:
    """A taken range of a segment this process maps, which another process on the host may be
    asked to fill: a kvstore `GetShared` straight into an engine's imports segment."""

    segment: str
    offset: int
    nbytes: int
    buf: memoryview  # the range's bytes

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes [offset, offset + nbytes) of the segment, which must lie in this range."""
        if not self.offset <= offset <= offset + nbytes <= self.offset + self.nbytes:
            raise ValueError(f"bytes {offset}+{nbytes} lie outside the range {self.offset}+{self.nbytes}")
        return self.buf[offset - self.offset:offset - self.offset + nbytes]


class RangeAllocator:
    """First-fit ranges of a byte span, cache-line aligned; frees merge with their neighbours."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (start, end), sorted, never adjacent

    @staticmethod
    def rounded(nbytes: int) -> int:
        return -(-max(1, nbytes) // ALIGN) * ALIGN

    def alloc(self, nbytes: int) -> Optional[int]:
        """The offset of a free range of `nbytes` (first fit), or None if none is that large."""
        n = self.rounded(nbytes)
        for i, (start, end) in enumerate(self._free):
            if end - start >= n:
                if end - start == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, end)
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Gives back a range `alloc(nbytes)` returned."""
        start, end = offset, offset + self.rounded(nbytes)
        i = 0
        while i < len(self._free) and self._free[i][0] < start:
            i += 1
        if i > 0 and self._free[i - 1][1] == start:  # joins the range before it
            i -= 1
            start = self._free.pop(i)[0]
        if i < len(self._free) and self._free[i][0] == end:  # and the one after it
            end = self._free.pop(i)[1]
        self._free.insert(i, (start, end))

    @property
    def free_bytes(self) -> int:
        return sum(end - start for start, end in self._free)


class ShmArena(RangeAllocator):
    """A segment this process created and owns (it unlinks it on close), with its ranges."""

    def __init__(self, shm: SharedMemory) -> None:
        super().__init__(shm.size)
        self._shm = shm

    @classmethod
    def create(cls, nbytes: int, what: str = "kvstore shared memory") -> Optional["ShmArena"]:
        """A new segment of `nbytes`, or None (with a warning) where /dev/shm lacks the room."""
        if shm_free_bytes() < 2 * nbytes:  # leave as much again for everyone else
            log.warning("%s off: /dev/shm has %d bytes free, %d wanted twice", what, shm_free_bytes(), nbytes)
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

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._shm.buf[offset:offset + nbytes]

    def close(self) -> None:
        try:
            self._shm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
        try:
            self._shm.unlink()
        except FileNotFoundError:  # removed under us: still tell the resource tracker it is gone
            resource_tracker.unregister(self._shm._name, "shared_memory")  # noqa: SLF001


class MappedSegment:
    """Another process's segment, mapped by name (read and write). Not registered with
    multiprocessing's resource tracker, which would unlink it when this process ends."""

    def __init__(self, name: str, size: int) -> None:
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"not a kvmesh segment name: {name!r}")
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._map)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.buf[offset:offset + nbytes]

    def close(self) -> None:
        try:
            self.buf.release()
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the last one
            pass
