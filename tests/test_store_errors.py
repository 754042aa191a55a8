"""Redis failures reach callers as one error of our own, and a role's long-running task
that ends on a fault nobody planned for stops the role rather than leaving it half alive.

The stores are the real ones with the real redis-py client, pointed at a port where no
Redis listens (the refusal is the operating system's, not a mock's), with no retries, so
each refusal is immediate.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from policies.errors import AuditError
from policies.redis_stores import (
    AsyncRedisReplayCache,
    AsyncRedisStreamAuditStore,
    RedisReplayCache,
    RedisStreamAuditStore,
)
from sluicegate.app.servers import free_port
from sluicegate.errors import StoreUnavailable
from sluicegate.store import reached
from sluicegate.supervise import TaskFailed, until_stopped


@pytest.fixture
def down() -> Iterator[redis.Redis]:
    client = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    yield client
    client.close()


@pytest_asyncio.fixture
async def adown() -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis(port=free_port(), retry=AsyncRetry(NoBackoff(), 0))
    yield client
    await client.aclose()


def test_the_policy_stores_name_what_redis_could_not_do(down: redis.Redis) -> None:
    with pytest.raises(StoreUnavailable, match="Redis could not claim a token nonce"):
        RedisReplayCache(down).claim(b"n", until=10.0, now=1.0)
    store = RedisStreamAuditStore(down, "audit:x")
    with pytest.raises(StoreUnavailable, match=r"append audit record 0 to 'audit:x'") as info:
        store.append(0, b"{}")
    assert not isinstance(info.value, AuditError)  # away is not a broken or forked chain
    with pytest.raises(StoreUnavailable, match="read the head of 'audit:x'"):
        store.last()
    with pytest.raises(StoreUnavailable, match="read 'audit:x'"):
        list(store.entries())


async def test_the_async_policy_stores_name_what_redis_could_not_do(
    adown: redis.asyncio.Redis,
) -> None:
    with pytest.raises(StoreUnavailable, match="Redis could not claim a token nonce"):
        await AsyncRedisReplayCache(adown).claim(b"n", until=10.0, now=1.0)
    store = AsyncRedisStreamAuditStore(adown, "audit:y")
    with pytest.raises(StoreUnavailable, match="append audit record 3 to 'audit:y'"):
        await store.append(3, b"{}")
    with pytest.raises(StoreUnavailable, match="read the head of 'audit:y'"):
        await store.last()


async def test_reached_translates_redis_errors_and_nothing_else(
    adown: redis.asyncio.Redis,
) -> None:
    with (
        pytest.raises(StoreUnavailable, match="Redis could not count: ConnectionError"),
        reached("count"),
    ):
        await adown.get("k")
    with pytest.raises(KeyError), reached("look up"):
        raise KeyError("ours")  # a fault of our own code stays what it is


async def test_until_stopped_returns_when_asked_to_stop() -> None:
    stop = asyncio.Event()
    forever = asyncio.create_task(asyncio.Event().wait(), name="forever")
    asyncio.get_running_loop().call_soon(stop.set)
    await asyncio.wait_for(until_stopped(stop, [forever]), 5)
    assert not forever.done()
    forever.cancel()


async def test_a_task_that_fails_stops_the_role_naming_it_and_its_fault() -> None:
    async def reaper() -> None:
        await asyncio.sleep(0)
        raise ValueError("no such worker")

    forever = asyncio.create_task(asyncio.Event().wait(), name="forever")
    failing = asyncio.create_task(reaper(), name="reaper")
    with pytest.raises(TaskFailed, match=r"task reaper ended: ValueError\('no such worker'\)"):
        await asyncio.wait_for(until_stopped(asyncio.Event(), [forever, failing]), 5)
    forever.cancel()


async def test_a_task_that_returns_early_stops_the_role_too() -> None:
    async def done_already() -> None:
        return None

    quitter = asyncio.create_task(done_already(), name="telemetry")
    with pytest.raises(TaskFailed, match="task telemetry ended: it returned"):
        await asyncio.wait_for(until_stopped(asyncio.Event(), [quitter]), 5)
