"""Shared fixtures. One private redis-server per test module: tests may kill and restart it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cluster.local_redis import LocalRedis


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    server = LocalRedis().start()
    try:
        yield server
    finally:
        server.close()
