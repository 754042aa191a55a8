"""How the broker calls Redis from its loops: Lua scripts inside pipelines by their sha,
without redis-py's per-pipeline ``SCRIPT EXISTS`` round trip, and a guard against
cancellations that redis-py loses.

redis-py checks every registered script before each pipeline that calls one, which costs a
whole extra round trip per burst of decisions. :class:`Lua` queues ``EVALSHA`` directly;
:func:`execute` runs a pipeline and, when Redis answers NOSCRIPT (it restarted, or its
script cache was flushed), loads the scripts and runs the pipeline once more. Every script
and every command sent this way must therefore be safe to run twice.

redis-py's asyncio client (8.1 at least; redis/redis-py#2028 describes the same) can swallow
a task's cancellation that lands during a command: the command returns and the task goes on,
so a loop that awaits Redis never ends at shutdown. :func:`check_cancelled`, called after
each Redis call in a loop, raises the cancellation the task had been sent. No decisions here.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError


class Lua:
    """One script, known by its sha1."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()

    def queue(self, pipe: Pipeline, keys: Sequence[str], args: Sequence[Any]) -> None:
        pipe.evalsha(self.sha, len(keys), *keys, *args)

    async def load(self, client: aioredis.Redis) -> None:
        await client.script_load(self.source)


def check_cancelled() -> None:
    """Raise ``CancelledError`` if the current task was cancelled and something swallowed it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def execute(
    client: aioredis.Redis, scripts: Sequence[Lua], build: Callable[[Pipeline], None]
) -> list[Any]:
    """Build a pipeline with ``build`` and run it (one round trip; two more after NOSCRIPT)."""
    for retry in (False, True):
        async with client.pipeline(transaction=False) as pipe:
            build(pipe)
            try:
                replies = list(await pipe.execute())
            except NoScriptError:
                if retry:
                    raise
            else:
                check_cancelled()
                return replies
        for script in scripts:
            await script.load(client)
    raise AssertionError("unreachable")
