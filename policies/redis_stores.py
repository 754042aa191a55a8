"""Redis backends: the replay cache (``SET NX PX``) and the audit log as a Redis stream,
each in a sync (``redis.Redis``) and an asyncio (``redis.asyncio.Redis``) flavour. Clients
must be created without ``decode_responses`` (records are bytes).

This is the only module of ``policies`` that imports ``redis``, and it holds every Redis key
name the package uses. Nonces expire by themselves once their token could no longer verify;
audit streams are never trimmed. Record ``seq`` is stored as the stream entry id
``<seq + 1>-0``, so Redis itself refuses a second writer that appends the same ``seq``
(``AuditConflict``) instead of forking the chain. Whatever else redis-py raises (Redis
down, a timeout, a refused command) leaves here as :class:`~policies.errors.StoreUnavailable`,
translated once by :func:`_reached`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import cast

import redis
import redis.asyncio

from policies.errors import AuditConflict, AuditError, StoreUnavailable

NONCE_PREFIX = "sluicegate:policy:nonce:"
AUDIT_PREFIX = "sluicegate:audit:"
_FIELD = b"r"
_BATCH = 500


def audit_stream_key(node_id: str) -> str:
    """The stream that holds ``node_id``'s audit log."""
    return AUDIT_PREFIX + node_id


@contextlib.contextmanager
def _reached(what: str) -> Iterator[None]:
    """Run one Redis call; its failure is ``StoreUnavailable`` naming ``what`` was asked."""
    try:
        yield
    except redis.RedisError as exc:
        raise StoreUnavailable(f"Redis could not {what}: {type(exc).__name__}: {exc}") from exc


def _ttl_ms(until: float, now: float) -> int:
    return max(1, math.ceil((until - now) * 1000))


class RedisReplayCache:
    """Replay cache shared by every process that talks to the same Redis."""

    def __init__(self, client: redis.Redis, prefix: str = NONCE_PREFIX) -> None:
        self.client, self.prefix = client, prefix

    def claim(self, nonce: bytes, until: float, now: float) -> bool:
        key = self.prefix + nonce.hex()
        with _reached("claim a token nonce"):
            return bool(self.client.set(key, b"1", nx=True, px=_ttl_ms(until, now)))


class AsyncRedisReplayCache:
    """``RedisReplayCache`` for asyncio callers."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str = NONCE_PREFIX) -> None:
        self.client, self.prefix = client, prefix

    async def claim(self, nonce: bytes, until: float, now: float) -> bool:
        key = self.prefix + nonce.hex()
        with _reached("claim a token nonce"):
            return bool(await self.client.set(key, b"1", nx=True, px=_ttl_ms(until, now)))

    async def claim_many(self, wanted: Sequence[tuple[bytes, float]], now: float) -> list[bool]:
        """Every ``SET NX`` in one pipelined round trip (no transaction: each claim stands
        alone, as separate calls would): a claim costs the worker's loop a quarter of its
        own round trip's CPU once eight go together."""
        if len(wanted) == 1:
            return [await self.claim(*wanted[0], now)]
        pipe = self.client.pipeline(transaction=False)
        for nonce, until in wanted:
            pipe.set(self.prefix + nonce.hex(), b"1", nx=True, px=_ttl_ms(until, now))
        with _reached(f"claim {len(wanted)} token nonces"):
            replies = await pipe.execute()
        return [bool(reply) for reply in replies]


def _conflict(stream: str, seq: int, exc: redis.ResponseError) -> AuditError:
    if "equal or smaller" in str(exc):
        return AuditConflict(f"stream {stream!r} already has record {seq}: another writer appended")
    return AuditError(f"stream {stream!r}: Redis refused record {seq}: {exc}")


Rows = list[tuple[bytes, dict[bytes, bytes]]]


def _rows(reply: object) -> Rows:
    """A stream reply, as redis-py returns it for a client without ``decode_responses``."""
    return cast(Rows, reply or [])


def _entry(fields: dict[bytes, bytes]) -> bytes:
    return fields.get(_FIELD, b"")


class RedisStreamAuditStore:
    """An audit log in one Redis stream (no MAXLEN: never trimmed)."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self.client, self.stream = client, stream

    def append(self, seq: int, entry: bytes) -> None:
        with _reached(f"append audit record {seq} to {self.stream!r}"):
            try:
                self.client.xadd(self.stream, {_FIELD: entry}, id=f"{seq + 1}-0")
            except redis.ResponseError as exc:
                raise _conflict(self.stream, seq, exc) from exc

    def last(self) -> bytes | None:
        with _reached(f"read the head of {self.stream!r}"):
            rows = _rows(self.client.xrevrange(self.stream, count=1))
        return _entry(rows[0][1]) if rows else None

    def entries(self) -> Iterator[bytes]:
        start = "-"
        while True:
            with _reached(f"read {self.stream!r}"):
                rows = _rows(self.client.xrange(self.stream, min=start, count=_BATCH))
            for _, fields in rows:
                yield _entry(fields)
            if len(rows) < _BATCH:
                return
            start = "(" + rows[-1][0].decode()


class AsyncRedisStreamAuditStore:
    """``RedisStreamAuditStore`` for asyncio callers: append, the head, and records read in
    bounded steps (``read``)."""

    def __init__(self, client: redis.asyncio.Redis, stream: str) -> None:
        self.client, self.stream = client, stream

    async def append(self, seq: int, entry: bytes) -> None:
        with _reached(f"append audit record {seq} to {self.stream!r}"):
            try:
                await self.client.xadd(self.stream, {_FIELD: entry}, id=f"{seq + 1}-0")
            except redis.ResponseError as exc:
                raise _conflict(self.stream, seq, exc) from exc

    async def last(self) -> bytes | None:
        with _reached(f"read the head of {self.stream!r}"):
            rows = _rows(await self.client.xrevrange(self.stream, count=1))
        return _entry(rows[0][1]) if rows else None

    async def read(self, seq: int, count: int) -> list[bytes]:
        """At most ``count`` records from record ``seq`` on, oldest first."""
        with _reached(f"read {self.stream!r} from record {seq}"):
            rows = _rows(await self.client.xrange(self.stream, min=f"{seq + 1}-0", count=count))
        return [_entry(fields) for _, fields in rows]
