"""Fixtures shared by every test tier.

Integration fixtures start real ``mosquitto`` and ``redis-server`` processes on free ports
(one of each per test session), and give each test its own topic prefix / key namespace so
tests never see each other's traffic.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from sluicegate.app.servers import (
    REDIS_DATABASES,
    ServerProcess,
    running,
    start_mosquitto,
    start_redis,
)


@pytest.fixture(scope="session", autouse=True)
def user_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Edge agents started without an outbox path keep it in the user's state directory:
    point that (and every subprocess's) at the session's temporary folder."""
    folder = tmp_path_factory.mktemp("xdg-state")
    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = before


@pytest.fixture(scope="session")
def mosquitto() -> Iterator[ServerProcess]:
    """A real Mosquitto for the whole session."""
    with running(start_mosquitto()) as server:
        yield server


@pytest.fixture
def own_mosquitto() -> Iterator[ServerProcess]:
    """A Mosquitto only this test uses, so it may kill and restart it."""
    with running(start_mosquitto()) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[ServerProcess]:
    """A real redis-server for the whole session."""
    with running(start_redis()) as server:
        yield server


@pytest.fixture(scope="session")
def fresh_redis_db(redis_server: ServerProcess) -> Callable[[], str]:
    """Hands out the URL of a database of the session's Redis that no other test of this
    process has had, flushed: a module's campus (its broker's keys, its audit streams, its
    usage records) never meets another's. Never a number written into a test file."""
    numbers = itertools.count(1)  # 0 is the redis_url fixture's, shared by namespaces

    def fresh() -> str:
        number = next(numbers)
        if number >= REDIS_DATABASES:
            raise RuntimeError(f"more than {REDIS_DATABASES - 1} Redis databases asked for")
        url = f"redis://{redis_server.host}:{redis_server.port}/{number}"
        client = redis.Redis.from_url(url)
        try:
            client.flushdb()
        finally:
            client.close()
        return url

    return fresh


@pytest.fixture
def redis_url(redis_server: ServerProcess) -> str:
    """Database 0 of the session's Redis: for tests that keep to a key namespace of their
    own (``unique``); one that needs a database to itself takes ``fresh_redis_db()``."""
    return f"redis://{redis_server.host}:{redis_server.port}/0"


@pytest.fixture
def unique() -> str:
    """A short unique token for topic prefixes, ids and Redis key namespaces."""
    return uuid.uuid4().hex[:10]
