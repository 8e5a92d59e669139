"""Test-wide setup: Triton's interpreter on the CPU, uvloop for async tests, a real redis-server."""
from __future__ import annotations

import os

import torch

# Triton kernels must be defined after this is set; on the CPU they only run interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import uvloop  # noqa: E402


def pytest_asyncio_loop_factories(config, item):
    return {"uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# `redis_url` / `redis_flush` fixtures: a real redis-server on a free port (tests/conftest_redis.py);
# a stuck test prints its pending asyncio tasks before pytest-timeout ends the run (tests/stall_dump.py).
pytest_plugins = ["conftest_redis", "stall_dump"]
