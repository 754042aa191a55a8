"""How the broker calls Redis from its loops: a round trip of commands packed by hiredis
and written on the client's pipelined lane, Lua scripts among them by their sha, and a
guard against cancellations that redis-py loses.

redis-py's pipeline builds a Python object per command, packs each in Python and runs
each reply through a callback: about 0.1 ms of CPU a round trip, where the broker makes
two or three a placement. :func:`execute` packs the commands with hiredis (redis-py's own
C parser, already installed beside it) and sends them on the client's lane
(:mod:`sluicegate.redis_lane`: one kept connection of the client's pool, which still makes
it: TLS, a Sentinel's master, the login, the database), whose replies hiredis parses as
they arrive; the client's retry policy still covers a lost connection, a timeout or a moved
master (the whole round trip is sent again). When Redis answers NOSCRIPT (it
restarted, or its script cache was flushed) :func:`execute` loads the scripts and sends the
round trip once more. Every script and every command sent this way must therefore be safe
to run twice. Replies come as Redis gives them (no redis-py callbacks: ``OK``, not True).

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

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import DataError, NoScriptError, ResponseError

from sluicegate.redis_lane import lane_of

Command = tuple[Any, ...]  # a command's name, then its arguments (str, bytes or numbers)


class Commands:
    """The commands of one round trip, in order; :func:`execute` returns a reply each."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Command] = []

    def add(self, *command: Any) -> None:
        self.items.append(command)


class Lua:
    """One script, known by its sha1."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()

    def call(self, keys: Sequence[str], args: Sequence[Any]) -> Command:
        """The ``EVALSHA`` command that runs the script on ``keys`` and ``args``."""
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    def queue(self, commands: Commands, keys: Sequence[str], args: Sequence[Any]) -> None:
        commands.items.append(self.call(keys, args))

    async def load(self, client: aioredis.Redis) -> None:
        await client.script_load(self.source)


def check_cancelled() -> None:
    """Raise ``CancelledError`` if the current task was cancelled and something swallowed it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def execute(
    client: aioredis.Redis, scripts: Sequence[Lua], build: Callable[[Commands], None]
) -> list[Any]:
    """The commands ``build`` adds, in one round trip (two more after NOSCRIPT); their
    replies in order. An error reply is raised (redis-py's type), after every reply was
    read; a lost connection is retried as the client's retry policy says; an argument
    Redis cannot take is redis-py's ``DataError``, before anything is sent."""
    commands = Commands()
    build(commands)
    try:
        packed = b"".join([hiredis.pack_command(c) for c in commands.items])
    except TypeError as exc:  # an argument Redis cannot take (None, a bool): redis-py's word
        raise DataError(f"a command Redis cannot take: {exc}") from exc
    count, lane = len(commands.items), lane_of(client)
    retry = client.get_retry() or Retry(NoBackoff(), 0)  # none: the client tries once
    for again in (False, True):
        replies = await retry.call_with_retry(lambda: lane.round_trip(packed, count), _lost)
        check_cancelled()
        errors = [r for r in replies if isinstance(r, ResponseError)]
        if not errors:
            return replies
        if again or not any(isinstance(e, NoScriptError) for e in errors):
            raise errors[0]
        for script in scripts:
            await script.load(client)
    raise AssertionError("unreachable")


async def _lost(error: Exception) -> None:
    """Between retries: the lane gave its connection up when it failed."""
