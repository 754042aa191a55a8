"""Atomic capacity reservations in Redis, shared by every broker replica.

A worker's reservations are the jobs placed on it and not yet completed. Reserving is one
Lua script — drop expired entries, count, add if below capacity — so two decisions, in one
replica or in two, can never oversubscribe a worker. Entries expire (a lost completion
cannot hold a slot for ever); a completion releases its entry at once. Many reservations
go to Redis in one pipeline, so a burst of decisions costs one round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from broker import keys

# KEYS[1] = reservation zset; ARGV = job id, now ms, expiry ms, capacity.
_RESERVE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 1
end
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
  redis.call('PEXPIREAT', KEYS[1], ARGV[3])
  return 1
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Hold:
    """One reservation to make: ``job_id`` on ``worker_id`` until ``until_ms``."""

    worker_id: str
    job_id: str
    capacity: int
    until_ms: int


class Reservations:
    """The Redis side of placement: atomic reservations (released by the broker's store)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._script = client.register_script(_RESERVE)

    async def reserve_many(self, holds: Sequence[Hold], now_ms: int) -> list[bool]:
        """Try every hold atomically (each on its own); one round trip for all of them."""
        if not holds:
            return []
        async with self._client.pipeline(transaction=False) as pipe:
            for h in holds:
                await self._script(
                    keys=[keys.reservations(h.worker_id)],
                    args=[h.job_id, now_ms, h.until_ms, h.capacity],
                    client=pipe,
                )
            replies = await pipe.execute()
        return [bool(int(r)) for r in replies]
