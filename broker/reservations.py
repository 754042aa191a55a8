"""Atomic capacity reservations in Redis, shared by every broker replica, and the in-flight
record of each placement made with them.

A worker's reservations are the jobs placed on it and not yet completed. Reserving is one
Lua script — drop expired entries, count, add if below capacity — so two decisions, in one
replica or in two, can never oversubscribe a worker. Entries expire (a lost completion
cannot hold a slot for ever); a completion releases its entry at once. The same script
records the placement in flight (``broker.inflight``: job -> edge, worker, attempt,
deadline; the job in the worker's in-flight set) so that whoever sees the worker die can
have the job placed again; it never lowers a job's attempt and keeps the job's crash count.
A dead-lettered job is never reserved again: the script answers with the dead letter's
reason instead, whichever replica asks. A placement its edge hands back unused
(:data:`RELEASE`) frees its slot at once.
Many reservations go to Redis in one pipeline, so a burst of decisions costs one round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from broker import keys
from broker.lua import Commands, Lua, execute
from sluicegate.store import reaching

# KEYS: the worker's reservations, the job's in-flight record, the worker's in-flight set,
# the in-flight workers index. ARGV: job id, now ms, expiry ms, capacity, worker, edge,
# attempt, deadline ms ('' for none), keep-until ms (in-flight record).
_RESERVE = """
if redis.call('HGET', KEYS[2], 'dead') == '1' then
  return redis.call('HGET', KEYS[2], 'dead_reason') or 'dead-lettered'
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
    return 0
  end
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
  redis.call('PEXPIREAT', KEYS[1], ARGV[3])
end
local current = tonumber(redis.call('HGET', KEYS[2], 'attempt') or '0')
if tonumber(ARGV[7]) < current then
  return 1
end
local now, keep = tonumber(ARGV[2]), tonumber(ARGV[9])
local function keep_until(key)
  local ttl = redis.call('PTTL', key)
  if ttl < 0 or now + ttl < keep then
    redis.call('PEXPIREAT', key, keep)
  end
end
redis.call('HSET', KEYS[2], 'worker', ARGV[5], 'edge', ARGV[6], 'attempt', ARGV[7],
  'deadline_at', ARGV[8], 'placed_at', ARGV[2])
keep_until(KEYS[2])
redis.call('ZADD', KEYS[3], keep, ARGV[1])
keep_until(KEYS[3])
local listed = redis.call('ZSCORE', KEYS[4], ARGV[5])
if not listed or tonumber(listed) < keep then
  redis.call('ZADD', KEYS[4], keep, ARGV[5])
end
return 1
"""
RESERVE = Lua(_RESERVE)

# An edge hands back a placement it did not use. Only the placement the in-flight record
# names (worker, edge and attempt alike) is released: a stale or foreign release is a no-op
# (0). The first release of it answers 1, any later one (every replica hears it) 2. The
# record stays, marked (its attempt and crash count matter to the next placement, which
# overwrites worker and attempt). KEYS: the worker's reservations, the job's in-flight
# record, the worker's in-flight set. ARGV: job id, worker, edge, attempt, now ms.
_RELEASE = """
local rec = redis.call('HMGET', KEYS[2], 'worker', 'edge', 'attempt', 'released_attempt')
if rec[1] ~= ARGV[2] or rec[2] ~= ARGV[3] or rec[3] ~= ARGV[4] then
  return 0
end
if rec[4] == ARGV[4] then
  return 2
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[2], 'released_attempt', ARGV[4], 'released_at', ARGV[5])
return 1
"""
RELEASE = Lua(_RELEASE)


@dataclass(frozen=True, slots=True)
class Hold:
    """One reservation to make: ``job_id`` on ``worker_id`` until ``until_ms``, for attempt
    ``attempt`` of a job that ``edge_id`` owns (deadline in unix seconds, if any)."""

    worker_id: str
    job_id: str
    capacity: int
    until_ms: int
    edge_id: str = ""
    attempt: int = 1
    deadline_at: float | None = None


class Reservations:
    """The Redis side of placement: atomic reservations (released by the broker's store)."""

    def __init__(self, client: aioredis.Redis, *, inflight_margin_ms: int = 3_600_000) -> None:
        self._client = client
        self._margin_ms = inflight_margin_ms

    @reaching("reserve worker slots")
    async def reserve_many(self, holds: Sequence[Hold], now_ms: int) -> list[bool | str]:
        """Try every hold atomically (each on its own); one round trip for all of them.
        Each answer: True (reserved), False (the worker is full) or, for a dead-lettered
        job, the dead letter's reason."""
        if not holds:
            return []

        def build(commands: Commands) -> None:
            for h in holds:
                deadline = "" if h.deadline_at is None else int(h.deadline_at * 1000)
                RESERVE.queue(
                    commands,
                    (
                        keys.reservations(h.worker_id),
                        keys.inflight(h.job_id),
                        keys.inflight_on(h.worker_id),
                        keys.inflight_workers(),
                    ),
                    (
                        h.job_id,
                        now_ms,
                        h.until_ms,
                        h.capacity,
                        h.worker_id,
                        h.edge_id,
                        h.attempt,
                        deadline,
                        h.until_ms + self._margin_ms,
                    ),
                )

        replies = await execute(self._client, (RESERVE,), build)
        return [_outcome(r) for r in replies]


def _outcome(reply: object) -> bool | str:
    if isinstance(reply, bytes):
        return reply.decode()
    if isinstance(reply, str):
        return reply
    return bool(int(reply))  # type: ignore[call-overload]
