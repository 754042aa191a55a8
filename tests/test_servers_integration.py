"""The fixtures really start servers that speak their protocols."""

from __future__ import annotations

import pytest
import redis

from sluicegate.app.servers import ServerProcess, _ping

pytestmark = pytest.mark.integration


def test_redis_fixture_answers(redis_url: str, unique: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set(f"t:{unique}", b"v")
    assert client.get(f"t:{unique}") == b"v"
    client.close()


def test_mosquitto_fixture_answers_connect(mosquitto: ServerProcess) -> None:
    assert _ping("mosquitto", mosquitto.host, mosquitto.port)
    assert mosquitto.process.poll() is None
