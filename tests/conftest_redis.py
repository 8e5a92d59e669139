"""`redis_url` fixture: one real redis-server per test session (see tests/redis_server.py).

Tests that share it must use their own key namespace or flush what they wrote; `redis_flush` gives
a clean database per test.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `redis_server` resolves from any rootdir
from redis_server import RedisServer  # noqa: E402


@pytest.fixture(scope="session")
def redis_url():
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def redis_flush(redis_url):
    """A redis URL whose database is empty at the start of the test."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=10)  # redis-py < 8 has no default
    client.flushdb()
    client.close()
    return redis_url
