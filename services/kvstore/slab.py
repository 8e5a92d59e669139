"""Slab: one preallocated buffer cut into equal block slots, in GPU memory or host memory.

Allocated once, so storing a block never mallocs; a block occupies one slot (its size may be smaller
than the slot). Free slots are a LIFO stack (reuse the warmest memory first). On the GPU a write goes
into a pinned `StagingRing` row and the rows of a put call reach their slots in one copy at its end
(`flush`; every read flushes first); `copy_out` reads many slots at once:
one gather and one device-to-host copy, not one waiting copy a block.
"""
from __future__ import annotations

import numpy as np

from kvmesh.kvstore.staging import StagingRing


def resolve_device(device: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu."""
    if device == "cpu":
        return "cpu"
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if device == "cuda" and not has_cuda:
        raise ValueError("--device cuda: no CUDA GPU is visible; use --device cpu or auto")
    return "cuda" if has_cuda else "cpu"


class Slab:
    def __init__(self, num_slots: int, slot_bytes: int, device: str = "cpu") -> None:
        if num_slots < 0 or slot_bytes <= 0:
            raise ValueError(f"slab needs num_slots >= 0 and slot_bytes > 0, got {num_slots}, {slot_bytes}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.device = device
        if device == "cuda":
            import torch
            self._gpu = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, device="cuda")  # [S, B]
            self._host = None
            self._staging = StagingRing(self._gpu)
        else:
            self._gpu = None
            self._staging = None
            self._host = np.empty((num_slots, slot_bytes), dtype=np.uint8)  # [S, B]
            self._host.fill(0)  # touch every page now, not on the first put into each slot
        self._free = list(range(num_slots - 1, -1, -1))  # stack; pops slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def write(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if n > self.slot_bytes:
            raise ValueError(f"block of {n} bytes exceeds the slot size {self.slot_bytes} (--block-bytes)")
        if self._host is not None:
            self._host[slot, :n] = np.frombuffer(data, dtype=np.uint8)  # [n], no copy of data
            return
        self._staging.write(slot, data)

    def flush(self) -> None:
        """Queues the GPU copies of the writes staged so far (a put call's end; reads do it first)."""
        if self._staging is not None:
            self._staging.flush()

    def read(self, slot: int, size: int) -> bytes:
        if self._host is not None:
            return self._host[slot, :size].tobytes()
        self.flush()
        return self._gpu[slot, :size].cpu().numpy().tobytes()

    def copy_out(self, slots: list[int], sizes: list[int]) -> "SlotCopy":
        """The bytes of `slots` (the first sizes[i] of each), copied now: on the GPU the gather is
        queued at once, so a later write into those slots cannot reach it; `SlotCopy.views` then
        waits for the one device-to-host copy."""
        if self._host is not None:
            return SlotCopy(self._host[slots], sizes)  # [n, B] (fancy indexing copies)
        import torch
        self.flush()
        idx = torch.tensor(slots, dtype=torch.int64).to(self._gpu.device)
        return SlotCopy(self._gpu.index_select(0, idx), sizes)  # [n, B] on the GPU

    def view(self, slot: int, size: int):
        """The slot's bytes in place (numpy uint8 [size] or torch uint8 [size] on the GPU), no copy."""
        if self._host is not None:
            return self._host[slot, :size]
        self.flush()
        return self._gpu[slot, :size]


class SlotCopy:
    """Slots' bytes taken out of a slab (`Slab.copy_out`): rows [n, slot_bytes] on the host, or on
    the GPU until `views` copies them over (call it off the event loop when `waits`)."""

    def __init__(self, rows, sizes: list[int]) -> None:
        self._rows = rows  # numpy uint8 [n, B], or torch uint8 [n, B] on the GPU
        self._sizes = sizes

    @property
    def waits(self) -> bool:
        """Whether `views` waits for a device-to-host copy."""
        return not isinstance(self._rows, np.ndarray)

    def views(self) -> list[memoryview]:
        """Each slot's bytes as a memoryview over one host copy of them all."""
        rows = self._rows if isinstance(self._rows, np.ndarray) else self._rows.cpu().numpy()
        return [memoryview(rows[i, :n]) for i, n in enumerate(self._sizes)]
