"""The broker's Redis round trip (``broker.lua.execute``) against a real Redis: replies in
order as Redis gives them, an error reply raised only after every reply was read (the
connection stays in step for the next round trip), a stopped Redis reaching the caller as
redis-py's error, and a restarted one served again by the same client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError

from broker.lua import Commands, Lua, execute
from sluicegate.app.servers import running, start_redis

pytestmark = pytest.mark.integration

ECHO = Lua("return {KEYS[1], ARGV[1]}")


@pytest_asyncio.fixture
async def rclient(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_replies_come_in_order_as_redis_gives_them(
    rclient: aioredis.Redis, unique: str
) -> None:
    key = f"rt:{unique}"
    await ECHO.load(rclient)  # else Redis answers NOSCRIPT and the whole trip goes twice

    def build(commands: Commands) -> None:
        commands.add("SET", key, "v", "EX", 60)
        commands.add("HSET", f"{key}:h", "a", 1, "b", "2")
        commands.add("HMGET", f"{key}:h", "a", "b", "c")
        ECHO.queue(commands, [key], ["x"])
        commands.add("PING")

    replies = await execute(rclient, [ECHO], build)
    assert replies == [b"OK", 2, [b"1", b"2", None], [key.encode(), b"x"], b"PONG"]
    assert await rclient.ttl(key) > 0


async def test_an_error_reply_is_raised_after_the_others_and_the_connection_stays_in_step(
    rclient: aioredis.Redis, unique: str
) -> None:
    key = f"rt:{unique}"
    await rclient.hset(key, "f", "1")

    def build(commands: Commands) -> None:
        commands.add("INCR", key)  # a hash: WRONGTYPE
        commands.add("SET", f"{key}:after", "written")

    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await execute(rclient, [], build)
    assert await rclient.get(f"{key}:after") == b"written"  # the command after it ran
    # The pool's connections read every reply: the next round trip gets its own.
    for n in range(5):
        replies = await execute(rclient, [], lambda c, n=n: c.add("ECHO", f"n{n}"))
        assert replies == [f"n{n}".encode()]


async def test_an_argument_redis_cannot_take_is_refused_before_anything_is_sent(
    rclient: aioredis.Redis, unique: str
) -> None:
    key = f"rt:{unique}"

    def build(commands: Commands) -> None:
        commands.add("SET", key, "first")
        commands.add("SET", f"{key}:none", None)

    with pytest.raises(DataError, match="cannot take"):
        await execute(rclient, [], build)
    assert await rclient.exists(key) == 0


async def test_after_noscript_the_scripts_are_loaded_and_the_whole_trip_sent_again(
    rclient: aioredis.Redis, unique: str
) -> None:
    key = f"rt:{unique}"
    await rclient.script_flush()

    def build(commands: Commands) -> None:
        commands.add("INCR", key)
        ECHO.queue(commands, [key], ["y"])

    assert await execute(rclient, [ECHO], build) == [2, [key.encode(), b"y"]]  # INCR twice
    assert await rclient.script_exists(ECHO.sha) == [True]


async def test_a_stopped_redis_is_a_connection_error_and_a_restarted_one_is_served() -> None:
    with running(start_redis()) as server:
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{server.port}/0", retry=None)
        try:
            assert await execute(client, [], lambda c: c.add("PING")) == [b"PONG"]
            await asyncio.to_thread(server.stop)
            with pytest.raises(RedisConnectionError):
                await execute(client, [], lambda c: c.add("PING"))
            await asyncio.to_thread(server.start)
            assert await execute(client, [ECHO], lambda c: ECHO.queue(c, ["k"], ["v"])) == [
                [b"k", b"v"]
            ]
        finally:
            await client.aclose()
