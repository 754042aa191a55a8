"""One pipelined lane to Redis per client: round trips written back to back on one
connection and answered in the order they were sent, with no task, lock or pool hand-off
per round trip.

Through redis-py's asyncio connections a round trip costs its caller about 0.13 ms of CPU
here (a pool get and release with their bookkeeping, a task around each send, a
StreamReader between the socket and the parser); through this lane about half that
(``docs/performance.md``, the broker's decision). The connection still comes from the
client's pool, so redis-py still makes it: TLS, a Sentinel's master, the login, the
database. The lane then takes that connection's transport for itself (``set_protocol``)
and keeps it until it is lost: hiredis parses the replies as they arrive and each round
trip gets its own, in order.

When the connection is lost, when Redis does not answer within the client's socket
timeout, or when a demoted master answers ``READONLY``, every round trip in flight fails
with redis-py's ``ConnectionError`` or ``TimeoutError`` (the errors a client's retry policy
retries), the connection goes back to the pool closed, and the next round trip opens
another. A round trip whose caller was cancelled still takes its replies, so those after it
stay in step. Error replies come back in place, as redis-py's exception types
(``NoScriptError``, ``ResponseError``), for the caller to raise. No decisions here.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluicegate.redis_url import FollowingPool

_NOT_YET = object()  # hiredis's answer while a reply is incomplete


class _RoundTrip:
    __slots__ = ("count", "future", "replies", "timer")

    def __init__(self, count: int, future: asyncio.Future[list[Any]]) -> None:
        self.count = count
        self.future = future
        self.replies: list[Any] = []
        self.timer: asyncio.TimerHandle | None = None


class _LaneProtocol(asyncio.Protocol):
    """The lane's end of one connection: writes round trips, hands replies back in order.
    The protocol it replaced (redis-py's stream) still hears of the connection's loss, so
    redis-py's own close of the connection completes."""

    def __init__(
        self,
        transport: asyncio.Transport,
        replaced: asyncio.BaseProtocol,
        reader: hiredis.Reader,
        timeout: float | None,
    ) -> None:
        self.transport = transport
        self.lost = False
        self._replaced = replaced
        self._reader = reader
        self._timeout = timeout
        self._waiting: deque[_RoundTrip] = deque()
        self._loop = asyncio.get_running_loop()

    def send(self, packed: bytes, count: int) -> asyncio.Future[list[Any]]:
        trip = _RoundTrip(count, self._loop.create_future())
        if self._timeout is not None:
            trip.timer = self._loop.call_later(self._timeout, self._timed_out)
        self._waiting.append(trip)
        self.transport.write(packed)
        return trip.future

    def data_received(self, data: bytes) -> None:
        reader, waiting = self._reader, self._waiting
        reader.feed(data)
        while True:
            reply = reader.gets()
            if reply is _NOT_YET:
                return
            if not waiting:  # a reply nobody asked for: the stream is out of step
                self.lose(RedisConnectionError("Redis sent a reply nobody asked for"))
                return
            trip = waiting[0]
            trip.replies.append(reply)
            if len(trip.replies) == trip.count:
                waiting.popleft()
                if trip.timer is not None:
                    trip.timer.cancel()
                if not trip.future.done():  # its caller may have been cancelled
                    trip.future.set_result(trip.replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lose(RedisConnectionError(f"the connection to Redis was lost: {exc or 'closed'}"))
        self._replaced.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return False  # close the transport: connection_lost follows

    def _timed_out(self) -> None:
        self.lose(RedisTimeoutError(f"Redis did not answer within {self._timeout} s"))

    def lose(self, error: Exception) -> None:
        """Fail every round trip in flight and give up the connection (out of step now)."""
        self.lost = True
        while self._waiting:
            trip = self._waiting.popleft()
            if trip.timer is not None:
                trip.timer.cancel()
            if not trip.future.done():
                trip.future.set_exception(error)
        if not self.transport.is_closing():
            self.transport.abort()


class Lane:
    """The pipelined lane of one client, opened on first use, reopened after a loss."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._pool = client.connection_pool
        # a Sentinel's master moves: the lane leaves a connection to the old one
        self._following = self._pool if isinstance(self._pool, FollowingPool) else None
        self._proto: _LaneProtocol | None = None
        self._conn: AbstractConnection | None = None
        self._opening: asyncio.Lock | None = None

    async def round_trip(self, packed: bytes, count: int) -> list[Any]:
        """Write ``packed`` (``count`` commands) and return their ``count`` replies."""
        proto, following = self._proto, self._following
        if following is not None and proto is not None and self._conn is not None:
            following.check_when_due()
            if not following.goes_to_master(self._conn):
                proto.lose(RedisConnectionError("Redis has a new master"))
        if proto is None or proto.lost:
            proto = await self._open()
        replies = await proto.send(packed, count)
        for reply in replies:
            if isinstance(reply, ReadOnlyError):  # a demoted master: find the new one
                demoted = RedisConnectionError("Redis answered READONLY: not the master")
                proto.lose(demoted)
                raise demoted
        return replies

    async def _open(self) -> _LaneProtocol:
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._proto is not None and not self._proto.lost:
                return self._proto  # another round trip opened it meanwhile
            if self._conn is not None:  # the lost one goes back to the pool, closed
                conn, self._conn = self._conn, None
                with contextlib.suppress(Exception):
                    await conn.disconnect(nowait=True)
                await self._pool.release(conn)
            # redis-py's deprecation decorator leaves get_connection untyped
            get = cast(Callable[[], Awaitable[AbstractConnection]], self._pool.get_connection)
            conn = await get()
            writer = cast(asyncio.StreamWriter, conn._writer)
            transport = cast(asyncio.Transport, writer.transport)
            kwargs: dict[str, Any] = {
                "protocolError": InvalidResponse,
                "replyError": BaseParser.parse_error,
                "notEnoughData": _NOT_YET,
            }
            if conn.encoder.decode_responses:
                kwargs["encoding"] = conn.encoder.encoding
                kwargs["errors"] = conn.encoder.encoding_errors
            proto = _LaneProtocol(
                transport, transport.get_protocol(), hiredis.Reader(**kwargs), conn.socket_timeout
            )
            transport.set_protocol(proto)
            self._conn, self._proto = conn, proto
            return proto


_lanes: weakref.WeakKeyDictionary[aioredis.Redis, Lane] = weakref.WeakKeyDictionary()


def lane_of(client: aioredis.Redis) -> Lane:
    """``client``'s lane, made on first use."""
    lane = _lanes.get(client)
    if lane is None:
        lane = _lanes[client] = Lane(client)
    return lane
