"""Copies between host and device that never wait for the device: what async scheduling needs, since
a step is in flight whenever the host prepares the next one.

PyTorch syncs the stream after a blocking copy from pageable memory (`torch.tensor(x, device=...)`,
`.tolist()` on a device tensor), which would wait for the step in flight. Pinned memory is not reused
before its copy is done (PyTorch's caching host allocator records the copy's stream).
"""
from __future__ import annotations

from typing import Optional

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A tensor [len(values)] of `dtype` on `device`, queued behind the device's work, not waiting on it."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def start_readback(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, ...], Optional[torch.cuda.Event]]:
    """Host copies of device tensors, being made: (pinned host tensors, the event after which they
    hold the values). On the CPU the tensors themselves and no event."""
    if not tensors[0].is_cuda:
        return tensors, None
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done
