"""StagingRing: pinned host rows that carry put blocks into a GPU slab without waiting for the GPU.

A copy from pageable memory to the GPU waits on the host while the driver stages it through a pinned
buffer of its own (one waiting copy a block, on the kvstore's event loop). Here a block is copied
into the next pinned row, and the row -> slot copy is queued asynchronously on the current stream:
the put returns at once, and every later read of the slot (queued on the same stream) sees the
bytes. Rows are reused half a ring at a time, once the copies out of that half have finished (one
event a half), so a write waits only when the GPU is a whole half ring behind.
"""
from __future__ import annotations

import numpy as np

RING_BYTES = 8 << 20  # pinned bytes a ring holds (at least two rows)


class StagingRing:
    def __init__(self, row_bytes: int, ring_bytes: int = RING_BYTES) -> None:
        import torch
        self._half = max(1, ring_bytes // 2 // row_bytes)
        self._rows = torch.empty((2 * self._half, row_bytes), dtype=torch.uint8, pin_memory=True)  # [R, B]
        self._host = self._rows.numpy()  # the same memory, for numpy's copy in
        self._done: list = [None, None]  # per half: an event after its last row's copy
        self._next = 0

    @property
    def num_rows(self) -> int:
        return 2 * self._half

    def copy_into(self, dst, data: bytes | bytearray | memoryview) -> None:
        """Queues `data` -> `dst` (a torch uint8 [len(data)] on the GPU) and returns without waiting."""
        import torch
        row = self._next
        half = row // self._half
        if row % self._half == 0 and self._done[half] is not None:
            self._done[half].synchronize()  # this half's previous copies have left its rows
            self._done[half] = None
        n = len(data)
        self._host[row, :n] = np.frombuffer(data, dtype=np.uint8)
        dst.copy_(self._rows[row, :n], non_blocking=True)
        self._next = (row + 1) % self.num_rows
        if self._next % self._half == 0:  # the half is full: mark when its copies are done
            self._done[half] = torch.cuda.Event()
            self._done[half].record()
