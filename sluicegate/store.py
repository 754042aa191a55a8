"""What the Redis client raises, translated once: every Redis call of the broker and the
pool runs inside :func:`reached` (or a method marked :func:`reaching`), so its failure —
Redis down, a timeout, a refused command — is :class:`~sluicegate.errors.StoreUnavailable`
naming what was asked, and callers catch that type, never redis-py's.

A Lua script the server does not hold (``NOSCRIPT``) is not a failure here: ``broker.lua``
reloads and retries before anything reaches this translation.

A Redis Sentinel failover (``sluicegate.redis_url``) fails calls for a few seconds with
redis-py's ``ConnectionError`` (the master gone; ``MasterNotFoundError`` while the sentinels
name none), ``TimeoutError`` and, from a master demoted under a client, ``ReadOnlyError``.
Each is a ``RedisError``, so each is ``StoreUnavailable`` here, and the roles' handling of
that (the broker refuses placements ``broker_unavailable``, the edge runs the job) holds
through a failover too (``tests/test_redis_sentinel.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator
from typing import ParamSpec, TypeVar

from redis.exceptions import RedisError

from sluicegate.errors import StoreUnavailable

P = ParamSpec("P")
T = TypeVar("T")


@contextlib.contextmanager
def reached(what: str) -> Iterator[None]:
    """Run Redis calls; a failure leaves as ``StoreUnavailable("Redis could not <what>")``."""
    try:
        yield
    except RedisError as exc:
        raise StoreUnavailable(f"Redis could not {what}: {type(exc).__name__}: {exc}") from exc


def reaching(what: str) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """Mark an async method whose Redis calls fail as :func:`reached` says."""

    def mark(method: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(method)
        async def call(*args: P.args, **kwargs: P.kwargs) -> T:
            with reached(what):
                return await method(*args, **kwargs)

        return call

    return mark
