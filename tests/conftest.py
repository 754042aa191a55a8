"""Fixtures shared by every test tier.

Integration fixtures start real ``mosquitto`` and ``redis-server`` processes on free ports
(one of each per test session), and give each test its own topic prefix / key namespace so
tests never see each other's traffic.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from sluicegate.servers import ServerProcess, running, start_mosquitto, start_redis


@pytest.fixture(scope="session")
def mosquitto() -> Iterator[ServerProcess]:
    """A real Mosquitto for the whole session."""
    with running(start_mosquitto()) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[ServerProcess]:
    """A real redis-server for the whole session."""
    with running(start_redis()) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: ServerProcess) -> str:
    return f"redis://{redis_server.host}:{redis_server.port}/0"


@pytest.fixture
def unique() -> str:
    """A short unique token for topic prefixes, ids and Redis key namespaces."""
    return uuid.uuid4().hex[:10]
