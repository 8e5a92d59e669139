"""PageSegments: two shared-memory segments that a worker and its engine process move KV pages
through, so that megabytes of pages never cross a pipe.

- exports: the engine copies a finished request's pages out of its pool straight into a range it
  takes and sends only the range, from its main thread once the copy has landed; the worker reads
  the pages in place and gives the range back ("release") once it has pushed them to the kvstore.
- imports: the worker copies the pages of an import into a range it takes, sends the range with
  the call, and takes the range back when the call's result comes.
A transfer that finds no room goes through the pipe as before. Why: on the H200 host a burst of
256 disaggregated 1,024-token prompts exported 1.7 GB of INT4 pages through one pipe, one request
behind another (docs/benchmarks.md, "Thirty-third session").

The worker creates both segments (`WorkerPages`) and unlinks them when it stops, whether or not
the engine process is still alive; the engine process maps them by name (`CorePages`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from kvmesh.shm_arena import MappedSegment, RangeAllocator, ShmArena

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentNames:
    """What the engine process needs to map the worker's segments."""

    exports: str
    imports: str
    size: int  # bytes of each


class WorkerPages:
    """The worker's side: owns both segments and the imports' ranges (taken and given back on the
    worker's event loop; the writer thread only copies into a taken range)."""

    def __init__(self, exports: ShmArena, imports: ShmArena) -> None:
        self.exports = exports
        self.imports = imports
        # exported pages are read through a mapping of their own, so that views still held when the
        # worker stops keep that mapping alive and the segment itself still closes and unlinks
        self._export_reader = MappedSegment(exports.name, exports.size)

    @classmethod
    def create(cls, total_bytes: int) -> Optional["WorkerPages"]:
        """Two segments of half `total_bytes` each, or None where /dev/shm lacks the room (warned)."""
        half = total_bytes // 2
        exports = ShmArena.create(half, "engine shared memory") if half > 0 else None
        imports = ShmArena.create(half, "engine shared memory") if exports is not None else None
        if imports is None:
            if exports is not None:
                exports.close()
            return None
        return cls(exports, imports)

    @property
    def names(self) -> SegmentNames:
        return SegmentNames(self.exports.name, self.imports.name, self.exports.size)

    def export_view(self, offset: int, nbytes: int) -> memoryview:
        return self._export_reader.view(offset, nbytes)

    @staticmethod
    def fill(view: memoryview, pages: Sequence[bytes | memoryview]) -> None:
        """Copies pages back to back into a taken range's view."""
        at = 0
        for p in pages:
            view[at:at + len(p)] = p
            at += len(p)

    def close(self) -> None:
        self._export_reader.close()
        self.exports.close()
        self.imports.close()


class CorePages:
    """The engine process's side: both segments mapped. The engine's exports land straight in
    ranges of the exports segment (`take`, its `export_space`): on a GPU the segment is page-locked
    for the device (cudaHostRegister), so the pages' copy out of the pool is the only copy. The main
    thread takes ranges (in a step) and gives them back (on the worker's "release")."""

    def __init__(self, names: SegmentNames, device: str = "cpu") -> None:
        """`device`: the engine's device type ("cuda": the exports segment is page-locked)."""
        import torch  # the engine process's side only: the worker's imports no torch

        self.exports = MappedSegment(names.exports, names.size)
        self.imports = MappedSegment(names.imports, names.size)
        self._ranges = RangeAllocator(names.size)
        self._memory = torch.frombuffer(self.exports.buf, dtype=torch.uint8)  # [size], the segment's bytes
        self._registered = False
        self.takes_exports = True
        if device == "cuda":
            err = torch.cuda.cudart().cudaHostRegister(self._memory.data_ptr(), names.size, 0)
            self._registered = self.takes_exports = int(err) == 0
            if not self._registered:  # a copy into pageable memory would wait: exports take the pipe
                log.warning("exports segment not page-locked (cudaHostRegister: %s); exports use the pipe", err)

    def take(self, nbytes: int) -> Optional[tuple[int, object]]:
        """(offset, uint8 tensor [nbytes] over it) of a free range, or None if none is that large."""
        offset = self._ranges.alloc(nbytes)
        return None if offset is None else (offset, self._memory[offset:offset + nbytes])

    def release_export(self, offset: int, nbytes: int) -> None:
        self._ranges.free(offset, nbytes)

    def close(self) -> None:
        if self._registered:
            import torch
            torch.cuda.cudart().cudaHostUnregister(self._memory.data_ptr())
        del self._memory
        self.exports.close()
        self.imports.close()
