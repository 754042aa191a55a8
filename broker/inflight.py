"""The Redis side of placed jobs in flight: claiming a dead worker's jobs, ending a job's
record when its current attempt completes, dead letters, and reading it all back.

Records are written by the reservation script (``broker.reservations``) as each placement
is granted: ``keys.inflight(job)`` (edge, worker, attempt, deadline, placed at; crashes and
the workers that died with it outlive the attempts), the job in ``keys.inflight_on(worker)``
and the worker in ``keys.inflight_workers()``. Nothing pending is trimmed: records expire
``inflight_margin_s`` after the job's deadline (or its token, without one), and a
dead-lettered record is kept for :data:`DEAD_LETTER_KEEP_S`.

Exactly one replica acts on a worker's death: :data:`CLAIM` takes the worker's whole
in-flight set in one atomic step, counts the crash on each job that the worker still held
at its current attempt and marks that attempt lost, so a second claim — another replica
that saw the same Last Will, or the same replica's silence sweep — finds nothing to do.
The scripts touch keys named from :data:`keys.INFLIGHT_PREFIX` inside Redis, so they need
one Redis (or Sentinel), not Redis Cluster. Decisions are ``broker.core.recovery``'s, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from broker import keys
from broker.core.recovery import Current, LostJob
from broker.lua import Commands, Lua, check_cancelled, execute
from broker.store import BrokerStore
from sluicegate.store import reaching
from sluicegate.wire_pool import retry_id

DEAD_LETTER_KEEP_S = 7 * 24 * 3600  # a dead letter stays listed and readable this long
FIELDS = ("edge", "worker", "attempt", "crashes", "crashed_on", "deadline_at", "placed_at")
DEAD_FIELDS = ("dead", "dead_reason", "dead_at", "lost")

# KEYS: the worker's in-flight set, the in-flight workers index. ARGV: worker, now ms,
# record key prefix. Returns {job, edge, attempt, crashes, crashed_on, deadline ms} per job.
_CLAIM = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
local jobs = redis.call('ZRANGE', KEYS[1], 0, -1)
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
local out = {}
for _, job in ipairs(jobs) do
  local key = ARGV[3] .. job
  local r = redis.call('HMGET', key, 'worker', 'attempt', 'lost', 'dead', 'edge', 'deadline_at')
  if r[1] == ARGV[1] and r[2] and r[3] ~= r[2] and r[4] ~= '1' then
    local crashes = redis.call('HINCRBY', key, 'crashes', 1)
    local on = redis.call('HGET', key, 'crashed_on')
    if on and on ~= '' then on = on .. ',' .. ARGV[1] else on = ARGV[1] end
    redis.call('HSET', key, 'lost', r[2], 'crashed_on', on)
    table.insert(out, {job, r[5] or '', r[2], tostring(crashes), on, r[6] or ''})
  end
end
return out
"""
CLAIM = Lua(_CLAIM)

# KEYS: the job's record, the worker's in-flight set. ARGV: job id, attempt that finished.
# Deletes the record only if it is still at that attempt (a new placement may have come).
_FINISH = """
if redis.call('HGET', KEYS[1], 'attempt') == ARGV[2] then
  redis.call('DEL', KEYS[1])
end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
FINISH = Lua(_FINISH)


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _ms_to_s(value: str) -> float | None:
    return int(value) / 1000.0 if value else None


def lost_jobs(reply: Sequence[Sequence[Any]]) -> list[LostJob]:
    """The claim script's reply as :class:`LostJob` values."""
    out = []
    for row in reply:
        job, edge, attempt, crashes, crashed_on, deadline = (_text(v) for v in row)
        out.append(
            LostJob(
                job_id=job,
                edge_id=edge,
                attempt=int(attempt),
                crashes=int(crashes),
                crashed_on=tuple(w for w in crashed_on.split(",") if w),
                deadline_at=_ms_to_s(deadline),
            )
        )
    return out


def current_of(reply: Sequence[Any]) -> Current | None:
    """An ``HMGET worker attempt lost dead`` reply as a :class:`Current` (None: no record)."""
    worker, attempt, lost, dead = (_text(v) for v in reply)
    if not attempt:
        return None
    return Current(int(attempt), worker, int(lost) if lost else None, dead == "1")


def record_of(raw: dict[Any, Any]) -> dict[str, Any] | None:
    """A record hash as the HTTP API shows it (numbers as numbers, times in unix seconds)."""
    if not raw:
        return None
    f = {_text(k): _text(v) for k, v in raw.items()}
    out: dict[str, Any] = {
        "edge": f.get("edge") or None,
        "worker": f.get("worker") or None,
        "attempt": int(f["attempt"]) if f.get("attempt") else None,
        "crashes": int(f.get("crashes") or 0),
        "crashed_on": [w for w in f.get("crashed_on", "").split(",") if w],
        "deadline_at": _ms_to_s(f.get("deadline_at", "")),
        "placed_at": _ms_to_s(f.get("placed_at", "")),
        "lost_attempt": int(f["lost"]) if f.get("lost") else None,
        # An attempt its edge handed back unused (no worker holds it any more).
        "released_attempt": int(f["released_attempt"]) if f.get("released_attempt") else None,
        "released_at": _ms_to_s(f.get("released_at", "")),
    }
    if f.get("dead") == "1":
        out["dead_letter"] = {
            "reason": f.get("dead_reason", ""),
            "at": _ms_to_s(f.get("dead_at", "")),
        }
        if f.get("retry_by"):  # an operator released it for one retry
            out["dead_letter"]["retry"] = {
                "by": f["retry_by"],
                "at": _ms_to_s(f.get("retry_at", "")),
                "job_id": f.get("retry_id") or None,
            }
    return out


class InflightStore:
    """Claims, completions and dead letters of placed jobs, over one Redis client; writes
    that nobody waits for go through the broker's batched :class:`BrokerStore`."""

    def __init__(self, client: aioredis.Redis, store: BrokerStore) -> None:
        self._client = client
        self._store = store

    @reaching("claim the jobs of lost workers")
    async def claim(self, workers: Sequence[str], now_ms: int) -> dict[str, list[LostJob]]:
        """Take every listed worker's jobs in flight (one round trip). A job comes back only
        to the one caller that claimed it for its current attempt."""
        if not workers:
            return {}

        def build(commands: Commands) -> None:
            for worker in workers:
                CLAIM.queue(
                    commands,
                    (keys.inflight_on(worker), keys.inflight_workers()),
                    (worker, now_ms, keys.INFLIGHT_PREFIX),
                )

        replies = await execute(self._client, (CLAIM,), build)
        return {w: lost_jobs(r) for w, r in zip(workers, replies, strict=True)}

    def current(self, job_id: str, then: Callable[[Current | None], None]) -> None:
        """Queue a read of the job's record; ``then`` gets it after the next pipeline."""
        self._store.read(
            lambda reply: then(current_of(reply)),
            "HMGET",
            keys.inflight(job_id),
            "worker",
            "attempt",
            "lost",
            "dead",
        )

    def finish(self, job_id: str, attempt: int, worker_id: str) -> None:
        """The job's ``attempt`` is done on ``worker_id``: its record goes if still current."""
        self._store.script(
            FINISH, (keys.inflight(job_id), keys.inflight_on(worker_id)), (job_id, attempt)
        )

    def unlist(self, job_id: str, worker_id: str) -> None:
        """``worker_id`` no longer holds the job."""
        self._store.write("ZREM", keys.inflight_on(worker_id), job_id)

    def dead_letter(self, job_id: str, reason: str, now: float) -> None:
        """Mark the job dead-lettered (kept and listed for :data:`DEAD_LETTER_KEEP_S`)."""
        now_ms = int(now * 1000)
        record = keys.inflight(job_id)
        self._store.write("HSET", record, "dead", "1", "dead_reason", reason, "dead_at", now_ms)
        self._store.write("EXPIRE", record, DEAD_LETTER_KEEP_S)
        self._store.write("ZADD", keys.dead_letters(), now_ms, job_id)
        self._store.write(
            "ZREMRANGEBYSCORE", keys.dead_letters(), "-inf", now_ms - DEAD_LETTER_KEEP_S * 1000
        )

    @reaching("list the workers holding jobs in flight")
    async def watched(self, now_ms: int) -> list[str]:
        """Workers holding jobs in flight (records not yet expired), campus-wide."""
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(keys.inflight_workers(), "-inf", now_ms)
            pipe.zrange(keys.inflight_workers(), 0, -1)
            _dropped, workers = await pipe.execute()
        check_cancelled()
        return [_text(w) for w in workers]

    @reaching("look up node records")
    async def listed(self, workers: Sequence[str]) -> list[bool]:
        """Whether each worker's node record (kept alive by its telemetry) is in Redis."""
        if not workers:
            return []
        async with self._client.pipeline(transaction=False) as pipe:
            for worker in workers:
                pipe.exists(keys.node(worker))
            found = await pipe.execute()
        check_cancelled()
        return [bool(n) for n in found]

    @reaching("count the jobs in flight on workers")
    async def jobs_on(self, workers: Sequence[str]) -> list[int]:
        """How many jobs each worker holds in flight."""
        if not workers:
            return []
        async with self._client.pipeline(transaction=False) as pipe:
            for worker in workers:
                pipe.zcard(keys.inflight_on(worker))
            counts = await pipe.execute()
        check_cancelled()
        return [int(n) for n in counts]

    @reaching("read a job's record in flight")
    async def record(self, job_id: str) -> dict[str, Any] | None:
        """The job's in-flight record for people (see :func:`record_of`)."""
        return record_of(await self._client.hgetall(keys.inflight(job_id)))

    @reaching("release a dead letter")
    async def release_dead_letter(self, job_id: str, by: str, now: float) -> dict[str, Any] | str:
        """Mark the dead letter released by ``by`` for one retry (``retry_id``) and take it
        off the list; its record (edge, attempt, worker, crashes, retry id), or why not."""
        key = keys.inflight(job_id)
        raw = await self._client.hgetall(key)
        record = record_of(raw)
        if record is None or "dead_letter" not in record:
            return f"release: job {job_id!r} is not a dead letter (or no longer listed)"
        retry = retry_id(job_id)
        if not await self._client.hsetnx(key, "retry_by", by):
            return f"release: dead letter {job_id!r} was released already"
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={"retry_at": int(now * 1000), "retry_id": retry})
            pipe.zrem(keys.dead_letters(), job_id)
            await pipe.execute()
        check_cancelled()
        return {**record, "retry_id": retry}

    @reaching("list the dead letters")
    async def dead_letters(self, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` dead letters, newest first, each with its record."""
        found: list[Any] = await self._client.zrevrange(
            keys.dead_letters(), 0, limit - 1, withscores=True
        )
        listed: list[tuple[str, float]] = [(_text(job), float(score)) for job, score in found]
        if not listed:
            return []
        async with self._client.pipeline(transaction=False) as pipe:
            for job, _score in listed:
                pipe.hgetall(keys.inflight(job))
            records = await pipe.execute()
        out = []
        for (job, score), raw in zip(listed, records, strict=True):
            record = record_of(raw) or {}
            dead = record.pop("dead_letter", None) or {"reason": None, "at": score / 1000.0}
            out.append({"job_id": job, **dead, **record})
        return out
