"""StagingRing: pinned host rows that carry put blocks into a GPU slab without waiting for the GPU.

A copy from pageable memory to the GPU waits on the host while the driver stages it through a pinned
buffer of its own (one waiting copy a block, on the kvstore's event loop). Here a block is copied
into the next pinned row and its slot noted; `flush` (at the end of a put call, before any read of
the slab, or once half the ring waits) queues one host-to-device copy of the waiting rows and one
scatter into their slots, on the current stream: the put returns at once, every later read of a
slot (queued on the same stream) sees its bytes, and a call of many blocks costs two GPU
operations, not one copy a block (~120 µs a 103 KiB block on the H200 host, docs/benchmarks.md,
"Thirty-third session"). Rows are reused half a ring at a time, once the copies out of that half
have finished (one event a half), so a write waits only when the GPU is a whole half ring behind.
"""
from __future__ import annotations

import numpy as np

RING_BYTES = 8 << 20  # pinned bytes a ring holds (at least two rows)


class StagingRing:
    def __init__(self, dst, ring_bytes: int = RING_BYTES) -> None:
        """`dst`: the slab, uint8 [S, row_bytes] on the GPU."""
        import torch
        row_bytes = dst.shape[1]
        self._dst = dst
        self._half = max(1, ring_bytes // 2 // row_bytes)
        self._rows = torch.empty((2 * self._half, row_bytes), dtype=torch.uint8, pin_memory=True)  # [R, B]
        self._host = self._rows.numpy()  # the same memory, for numpy's copy in
        self._done: list = [None, None]  # per half: an event after its last flushed row's copy
        self._next = 0
        self._waiting: dict[int, int] = {}  # slot -> row, staged and not yet flushed (rows consecutive)

    @property
    def num_rows(self) -> int:
        return 2 * self._half

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def write(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        """Copies `data` into a pinned row for slot `slot` (its first len(data) bytes) and returns
        without touching the GPU; `data` may be reused at once."""
        if slot in self._waiting or len(self._waiting) >= self._half:  # keep writes in order; bound a flush
            self.flush()
        row = self._next
        half = row // self._half
        if row % self._half == 0 and self._done[half] is not None:
            self._done[half].synchronize()  # this half's previous copies have left its rows
            self._done[half] = None
        self._host[row, :len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._waiting[slot] = row
        self._next = (row + 1) % self.num_rows

    def flush(self) -> None:
        """Queues the waiting rows' copies into their slots (whole rows: a slot's bytes past its
        block are never read)."""
        if not self._waiting:
            return
        import torch
        slots, rows = list(self._waiting), list(self._waiting.values())
        self._waiting.clear()
        cut = next((i for i in range(1, len(rows)) if rows[i] != rows[i - 1] + 1), len(rows))  # the ring wrapped
        for part_slots, part_rows in ((slots[:cut], rows[:cut]), (slots[cut:], rows[cut:])):
            if not part_rows:
                continue
            src = self._rows[part_rows[0]:part_rows[-1] + 1].to(self._dst.device, non_blocking=True)  # [n, B]
            idx = torch.tensor(part_slots, dtype=torch.int64).pin_memory().to(self._dst.device, non_blocking=True)
            self._dst.index_copy_(0, idx, src)
        done = torch.cuda.Event()
        done.record()
        for row in rows:  # every half a flushed row lies in: its rows are free once this event is
            self._done[row // self._half] = done
