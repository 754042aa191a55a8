"""The fixtures really start servers that speak their protocols."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from sluicegate.app.servers import EPHEMERAL_RANGE, ServerProcess, _ping, free_port

pytestmark = pytest.mark.integration


def test_redis_fixture_answers(redis_url: str, unique: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set(f"t:{unique}", b"v")
    assert client.get(f"t:{unique}") == b"v"
    client.close()


def test_a_free_port_is_one_no_outgoing_connection_can_take() -> None:
    """Below the kernel's ephemeral range, where connections get their own ports, and free."""
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= port < low for port in ports)
    assert len(set(ports)) > 40  # drawn, not one port handed to every server
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[0]))  # nothing holds it
        sock.listen()
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=5) as conn:
            assert conn.getsockname()[1] >= low  # the client's own port is from the range


def test_ports_handed_out_and_not_yet_bound_are_not_handed_out_again() -> None:
    """A campus asks for dozens of ports before its servers bind them: each must differ."""
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_mosquitto_fixture_answers_connect(mosquitto: ServerProcess) -> None:
    assert _ping("mosquitto", mosquitto.host, mosquitto.port)
    assert mosquitto.process.poll() is None


def test_each_fresh_redis_database_is_a_tests_own(fresh_redis_db: Callable[[], str]) -> None:
    first, second = fresh_redis_db(), fresh_redis_db()
    assert first != second
    a, b = redis.Redis.from_url(first), redis.Redis.from_url(second)
    try:
        a.set("campus:key", "1")
        assert b.get("campus:key") is None
    finally:
        a.close()
        b.close()


def test_no_test_names_a_redis_database_by_number() -> None:
    # Two modules that picked the same number of the session's Redis shared their data (one
    # failed a CI run): its databases come from fresh_redis_db() only, and conftest's
    # redis_url keeps to database 0. Servers a test starts for itself are its own.
    here = Path(__file__).parent
    numbered = re.compile(r"redis_server\.port\}/\d|/\{(?:REDIS_)?DB\}|redis_server\.port, db=")
    found = [
        f"{path.relative_to(here)}:{number}"
        for path in sorted(here.rglob("*.py"))
        if path.name not in ("conftest.py", "test_redis_sentinel.py")  # its servers: its own
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if numbered.search(line) and "numbered = " not in line
    ]
    assert found == []
