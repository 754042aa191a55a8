"""The pipelined lane to Redis (``sluicegate.redis_lane``) against a real Redis, on both
event loops the product runs (asyncio's and uvloop's): round trips sent together each get
their own replies in order, a cancelled caller leaves the rest in step, a lost connection
and a Redis that does not answer fail what was in flight as the errors a retry policy
retries and the next round trip is served on a new connection, error replies come back in
place as redis-py's types, and closing the client closes the lane."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import hiredis
import pytest
import redis.asyncio as aioredis
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluicegate.redis_lane import lane_of

pytestmark = pytest.mark.integration

Runner = Callable[[Awaitable[Any]], Any]
LOOPS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])


def pack(*commands: tuple[Any, ...]) -> bytes:
    return b"".join(hiredis.pack_command(c) for c in commands)


@LOOPS
def test_round_trips_sent_together_each_get_their_own_replies(
    run: Runner, redis_url: str, unique: str
) -> None:
    async def go() -> list[list[Any]]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            lane = lane_of(client)
            trips = [
                lane.round_trip(pack(("ECHO", f"{unique}-{i}"), ("INCR", f"lane:{unique}")), 2)
                for i in range(50)
            ]
            return await asyncio.gather(*trips)
        finally:
            await client.aclose()

    replies = run(go())
    assert [r[0] for r in replies] == [f"{unique}-{i}".encode() for i in range(50)]
    assert [r[1] for r in replies] == list(range(1, 51))  # sent, and answered, in order


@LOOPS
def test_a_cancelled_caller_leaves_the_next_round_trip_in_step(
    run: Runner, redis_url: str, unique: str
) -> None:
    async def go() -> list[Any]:
        client = aioredis.Redis.from_url(redis_url)
        other = aioredis.Redis.from_url(redis_url)
        try:
            lane = lane_of(client)
            blocked = asyncio.ensure_future(lane.round_trip(pack(("BLPOP", f"q:{unique}", 5)), 1))
            after = asyncio.ensure_future(lane.round_trip(pack(("ECHO", "after")), 1))
            await asyncio.sleep(0)  # both written
            blocked.cancel()
            await other.rpush(f"q:{unique}", "item")  # the BLPOP's reply comes, then ECHO's
            return await asyncio.wait_for(after, 5)
        finally:
            await client.aclose()
            await other.aclose()

    assert run(go()) == [b"after"]


@LOOPS
def test_a_killed_connection_fails_what_was_in_flight_and_the_next_trip_reconnects(
    run: Runner, redis_url: str, unique: str
) -> None:
    async def go() -> tuple[BaseException | None, int, int, list[Any]]:
        client = aioredis.Redis.from_url(redis_url)
        other = aioredis.Redis.from_url(redis_url)
        try:
            lane = lane_of(client)
            (first_id,) = await lane.round_trip(pack(("CLIENT", "ID")), 1)
            waiting = asyncio.ensure_future(lane.round_trip(pack(("BLPOP", f"q:{unique}", 5)), 1))
            await asyncio.sleep(0)
            await other.client_kill_filter(_id=first_id)
            error = None
            try:
                await asyncio.wait_for(waiting, 5)
            except RedisConnectionError as exc:
                error = exc
            (second_id,) = await lane.round_trip(pack(("CLIENT", "ID")), 1)
            return error, first_id, second_id, await lane.round_trip(pack(("PING",)), 1)
        finally:
            await client.aclose()
            await other.aclose()

    error, first_id, second_id, pong = run(go())
    assert isinstance(error, RedisConnectionError), error
    assert second_id != first_id
    assert pong == [b"PONG"]


@LOOPS
def test_a_redis_that_does_not_answer_in_the_socket_timeout_is_a_timeout_error(
    run: Runner, redis_url: str, unique: str
) -> None:
    async def go() -> tuple[BaseException | None, list[Any]]:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=0.2)
        try:
            lane = lane_of(client)
            error = None
            try:  # BLPOP holds its answer for 2 s: past the client's 0.2 s
                await asyncio.wait_for(lane.round_trip(pack(("BLPOP", f"q:{unique}", 2)), 1), 5)
            except RedisTimeoutError as exc:
                error = exc
            return error, await lane.round_trip(pack(("ECHO", "again")), 1)
        finally:
            await client.aclose()

    error, again = run(go())
    assert isinstance(error, RedisTimeoutError), error
    assert "0.2" in str(error)
    assert again == [b"again"]  # on a new connection: the old one was out of step


@LOOPS
def test_error_replies_come_back_in_place_as_redis_py_types(run: Runner, redis_url: str) -> None:
    async def go() -> list[Any]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await lane_of(client).round_trip(pack(("EVALSHA", "0" * 40, 0), ("PING",)), 2)
        finally:
            await client.aclose()

    missing, pong = run(go())
    assert isinstance(missing, NoScriptError)
    assert pong == b"PONG"


@LOOPS
def test_closing_the_client_closes_its_lane(run: Runner, redis_url: str, unique: str) -> None:
    async def go() -> BaseException | None:
        client = aioredis.Redis.from_url(redis_url)
        lane = lane_of(client)
        await lane.round_trip(pack(("PING",)), 1)
        waiting = asyncio.ensure_future(lane.round_trip(pack(("BLPOP", f"q:{unique}", 5)), 1))
        await asyncio.sleep(0)
        await asyncio.wait_for(client.aclose(), 5)
        try:
            await asyncio.wait_for(waiting, 5)
        except RedisConnectionError as exc:
            return exc
        return None

    assert isinstance(run(go()), RedisConnectionError)
