"""PageSegments: two shared-memory segments that a worker and its engine process move KV pages
through, so that megabytes of pages never cross a pipe.

- exports: the engine copies a finished request's pages out of its pool straight into a range it
  takes and sends only the range, from its main thread once the copy has landed; the worker reads
  the pages in place and gives the range back ("release") once it has pushed them to the kvstore.
- imports: the worker copies the pages of an import into a range it takes and sends the range
  with the call; the engine copies them into its pool straight from there and says when that copy
  has landed ("imported"), and the worker takes the range back then.
A transfer that finds no room goes through the pipe as before. Why: on the H200 host a burst of
256 disaggregated 1,024-token prompts exported 1.7 GB of INT4 pages through one pipe, one request
behind another (docs/benchmarks.md, "Thirty-third session").

The worker creates both segments (`WorkerPages`) and unlinks them when it stops, whether or not
the engine process is still alive; the engine process maps them by name (`CorePages`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from kvmesh.shm_arena import MappedSegment, RangeAllocator, SegmentRange, ShmArena

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentNames:
    """What the engine process needs to map the worker's segments."""

    exports: str
    imports: str
    size: int  # bytes of each


class WorkerPages:
    """The worker's side: owns both segments and the imports' ranges (taken and given back on the
    worker's event loop; the writer thread only copies into a taken range). An import's range is
    held by its call until the engine says its copy out of it has landed (`hold`, `landed`)."""

    def __init__(self, exports: ShmArena, imports: ShmArena) -> None:
        self.exports = exports
        self.imports = imports
        # exported pages are read through a mapping of their own, so that views still held when the
        # worker stops keep that mapping alive and the segment itself still closes and unlinks
        self._export_reader = MappedSegment(exports.name, exports.size)
        self._held: dict[int, tuple[int, int]] = {}  # call id -> its imports range, until "imported"
        self._freed = asyncio.Event()  # set whenever an imports range comes back (`reserve` waits)
        self.closed = False

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

    async def reserve(self, nbytes: int, timeout: float) -> Optional[SegmentRange]:
        """A free imports range of `nbytes`, waiting up to `timeout` s for ranges to come back; None
        if it can never fit, none came free in time, or the segments closed meanwhile."""
        if not 0 < nbytes <= self.imports.size or self.closed:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (offset := self.imports.alloc(nbytes)) is None:
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return None
            if self.closed:
                return None
        return SegmentRange(self.imports.name, offset, nbytes, self.imports.view(offset, nbytes))

    def give_back(self, offset: int, nbytes: int) -> None:
        """An imports range back, and whoever waits for room woken."""
        self.imports.free(offset, nbytes)
        self._freed.set()

    def hold(self, call_id: int, offset: int, nbytes: int) -> None:
        """The range an import call's pages lie in, kept until `landed(call_id)`."""
        self._held[call_id] = (offset, nbytes)

    def landed(self, call_id: int) -> None:
        """The engine's copy out of the call's range has landed ("imported"): the range comes back."""
        taken = self._held.pop(call_id, None)
        if taken is not None:
            self.give_back(*taken)

    def give_back_held(self) -> None:
        """Every held range back (the engine process is gone: no "imported" will come)."""
        for taken in self._held.values():
            self.imports.free(*taken)
        self._held.clear()
        self._freed.set()

    @staticmethod
    def in_place(blocks: Sequence, reserved: SegmentRange) -> bool:
        """Whether the blocks (ExportedBlock) lie in `reserved` back to back from its start, in order
        (each block's `shared` names its spot)."""
        at = reserved.offset
        for b in blocks:
            if b.shared != (reserved.segment, at):
                return False
            at += len(b.data)
        return at <= reserved.offset + reserved.nbytes

    @staticmethod
    def fill(view: memoryview, pages: Sequence[bytes | memoryview]) -> None:
        """Copies pages back to back into a taken range's view."""
        at = 0
        for p in pages:
            view[at:at + len(p)] = p
            at += len(p)

    def close(self) -> None:
        self.closed = True
        self._freed.set()  # waiters for room see the segments gone
        self._export_reader.close()
        self.exports.close()
        self.imports.close()


class CorePages:
    """The engine process's side: both segments mapped. The engine's exports land straight in
    ranges of the exports segment (`take`, its `export_space`), and imports are copied straight
    out of the imports segment (`import_rows`): on a GPU both segments are page-locked for the
    device (cudaHostRegister), so the copy between the pool and the segment is the only copy. The
    main thread takes export ranges (in a step) and gives them back (on the worker's "release");
    an import's range stays the worker's until its copy has landed (`mark_import`, `landed_imports`)."""

    def __init__(self, names: SegmentNames, device: str = "cpu") -> None:
        """`device`: the engine's device type ("cuda": the segments are page-locked)."""
        import torch  # the engine process's side only: the worker's imports no torch

        self._torch = torch
        self._cuda = device == "cuda"
        self.exports = MappedSegment(names.exports, names.size)
        self.imports = MappedSegment(names.imports, names.size)
        self._ranges = RangeAllocator(names.size)
        self._memory = torch.frombuffer(self.exports.buf, dtype=torch.uint8)  # [size], the segment's bytes
        self._import_memory = torch.frombuffer(self.imports.buf, dtype=torch.uint8)  # [size]
        self._registered: list = []  # tensors whose memory is page-locked here
        self._importing: collections.deque = collections.deque()  # (call id, event or None), in call order
        self.takes_exports = self._register(self._memory, "exports")
        self.copies_imports = self._register(self._import_memory, "imports")

    def _register(self, memory, what: str) -> bool:
        """Page-locks a segment for the GPU; on the CPU nothing to do. False: a copy would go
        through pageable memory and wait, so that direction keeps its staging copy or the pipe."""
        if not self._cuda:
            return True
        err = self._torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(), 0)
        if int(err) != 0:
            log.warning("%s segment not page-locked (cudaHostRegister: %s); %s take a staging copy or the pipe",
                        what, err, what)
            return False
        self._registered.append(memory)
        return True

    def take(self, nbytes: int) -> Optional[tuple[int, object]]:
        """(offset, uint8 tensor [nbytes] over it) of a free range, or None if none is that large."""
        offset = self._ranges.alloc(nbytes)
        return None if offset is None else (offset, self._memory[offset:offset + nbytes])

    def release_export(self, offset: int, nbytes: int) -> None:
        self._ranges.free(offset, nbytes)

    def import_rows(self, offset: int, nbytes: int, count: int):
        """An import's pages as uint8 [count, nbytes / count] over the imports segment, for a copy
        straight out of it; None where the segment is not page-locked (the pages are then staged)."""
        if not self.copies_imports or count == 0:
            return None
        return self._import_memory[offset:offset + nbytes].view(count, nbytes // count)

    def mark_import(self, call_id: int) -> None:
        """After an import's copies are queued: its range may be given back once the stream passes here."""
        event = None
        if self._cuda:
            event = self._torch.cuda.Event()
            event.record()
        self._importing.append((call_id, event))

    def landed_imports(self, wait: bool) -> list[int]:
        """Call ids of the imports whose copies out of the segment are done (all, waiting, when `wait`)."""
        done = []
        while self._importing and (wait or self._importing[0][1] is None or self._importing[0][1].query()):
            call_id, event = self._importing.popleft()
            if event is not None:
                event.synchronize()
            done.append(call_id)
        return done

    def close(self) -> None:
        for memory in self._registered:
            self._torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())
        self._registered.clear()
        del self._memory, self._import_memory
        self.exports.close()
        self.imports.close()
