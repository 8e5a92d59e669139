"""Copies between host and device that never wait for the device: what async scheduling needs, since
a step is in flight whenever the host prepares the next one.

PyTorch syncs the stream after a blocking copy from pageable memory (`torch.tensor(x, device=...)`,
`.tolist()` or `.cpu()` of a device tensor), which would wait for the step in flight. Here copies go
through pinned memory, queued on the stream; pinned memory is not reused before its copy is done
(PyTorch's caching host allocator records the copy's stream). Beside a step's inputs and tokens, the
pages a finished request exports and those a worker imports move this way, a batch in one copy
(`KVCache.copy_out` / `write_pages`): read one by one, each page had waited for the step in flight.
On the CPU every copy is a plain synchronous one.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A tensor [len(values)] of `dtype` on `device`, queued behind the device's work, not waiting on it."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def start_readback(tensors: tuple[torch.Tensor, ...], into: Sequence[Optional[torch.Tensor]] = ()
                   ) -> tuple[tuple[torch.Tensor, ...], Optional[torch.cuda.Event]]:
    """Host copies of device tensors, being made: (pinned host tensors, the event after which they
    hold the values). On the CPU the tensors themselves and no event. `into[i]`, if given: where
    tensor i lands (host memory of its shape and dtype, page-locked for a device tensor; on the CPU
    it is copied there at once)."""
    into = tuple(into) + (None,) * (len(tensors) - len(into))
    if not tensors[0].is_cuda:
        return tuple(t if d is None else d.copy_(t) for t, d in zip(tensors, into)), None
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if d is None else d
                 for t, d in zip(tensors, into))
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class HostCopy:
    """Tensors on their way to host memory (`start_readback`), read as bytes: the first read waits
    for the copy, once. Give it copies nothing writes to (on the CPU they are what is read). Call
    `wait()` from a worker thread to keep an event loop free (the wait releases the GIL)."""

    def __init__(self, tensors: Sequence[torch.Tensor], into: Sequence[Optional[torch.Tensor]] = ()) -> None:
        self._host, self._event = start_readback(tuple(tensors), into)

    def done(self) -> bool:
        """Whether the copy has landed (never waits)."""
        return self._event is None or self._event.query()

    def wait(self) -> "HostCopy":
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self

    def rows(self, i: int) -> list[bytes]:
        """The rows (first dimension) of tensor `i`, as bytes each."""
        a = self.wait()._host[i].view(torch.uint8).numpy()
        return [a[r].tobytes() for r in range(a.shape[0])]

    def whole(self, i: int) -> bytes:
        """Tensor `i` as one bytes object."""
        return self.wait()._host[i].view(torch.uint8).numpy().tobytes()

    def buffer(self, i: int) -> memoryview:
        """Tensor `i`'s bytes in place (valid while this copy lives): for a writer that copies them on."""
        return memoryview(self.wait()._host[i].view(torch.uint8).numpy().reshape(-1))  # [nbytes], maybe 0


def bytes_to_device(chunks: Sequence[bytes | memoryview], dtype: torch.dtype, shape: tuple[int, ...],
                    device: torch.device) -> torch.Tensor:
    """One tensor [len(chunks), *shape] of `dtype` on `device` from equal-sized byte chunks, queued
    from pinned memory on a GPU (use it on the current stream only)."""
    row = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    host = torch.empty((len(chunks), row), dtype=torch.uint8, pin_memory=device.type == "cuda")
    a = host.numpy()
    for i, c in enumerate(chunks):
        a[i] = np.frombuffer(c, dtype=np.uint8)
    typed = host.view(dtype).view(len(chunks), *shape)
    return typed.to(device, non_blocking=True) if device.type == "cuda" else typed
