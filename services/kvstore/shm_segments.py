"""SharedSegments: the clients' shared-memory segments a kvstore server reads puts from and writes
gets into (`PutShared`, `GetShared`), each opened once by name.

Only "kvmesh-" names are opened and every range is checked against its segment's size. Whenever a
new segment is opened, those whose client went away (it unlinked its segment, or its resource
tracker did) are closed, so a restarted worker's old segment does not stay mapped; past `limit` the
least recently used goes too. A segment
that cannot be opened (the client is on another host or in another container) raises
`SegmentUnavailable`: the server answers FAILED_PRECONDITION and the client falls back to the
batched calls.
"""
from __future__ import annotations

import mmap
import os
from collections import OrderedDict

import _posixshmem  # what multiprocessing.shared_memory opens segments with

from kvmesh.shm_arena import PREFIX


SHM_DIR = "/dev/shm"  # where Linux keeps shm_open's names


class SegmentUnavailable(ValueError):
    pass


def _open(name: str) -> mmap.mmap:
    """The segment mapped read-write. Not through `SharedMemory`: before Python 3.13 that registers
    it with this process's resource tracker, which would unlink the client's segment at our exit."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class SharedSegments:
    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._open: OrderedDict[str, mmap.mmap] = OrderedDict()

    def view(self, name: str, offset: int, nbytes: int) -> memoryview:
        """Bytes [offset, offset + nbytes) of segment `name` (ValueError if out of its bounds). Use it
        in a `with` block: a segment is closed only once no view of it is left."""
        shm = self._segment(name)
        if offset < 0 or nbytes < 0 or offset + nbytes > len(shm):
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside segment {name!r} of {len(shm)} bytes")
        return memoryview(shm)[offset:offset + nbytes]

    def _segment(self, name: str) -> mmap.mmap:
        shm = self._open.get(name)
        if shm is not None:
            self._open.move_to_end(name)
            return shm
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"segment {name!r} is not a kvmesh client's (names start with {PREFIX!r})")
        try:
            shm = _open(name)
        except OSError as e:
            raise SegmentUnavailable(f"cannot open shared-memory segment {name!r}: {e}") from e
        for gone in [n for n in self._open if not os.path.exists(f"{SHM_DIR}/{n}")]:
            self._close(self._open.pop(gone))
        self._open[name] = shm
        while len(self._open) > self.limit:
            self._close(self._open.popitem(last=False)[1])
        return shm

    @staticmethod
    def _close(shm: mmap.mmap) -> None:
        try:
            shm.close()
        except BufferError:  # a view is still alive: the mapping goes when it does
            pass

    def close(self) -> None:
        while self._open:
            self._close(self._open.popitem()[1])
