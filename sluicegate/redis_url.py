"""Where a role's Redis is, from its ``redis_url``: one server, or a master that Redis
Sentinel watches and replaces on failure. Every role makes its Redis client here
(:func:`async_client`, :func:`sync_client`), never with redis-py's ``from_url``.

``redis://``, ``rediss://`` and ``unix://`` URLs go to redis-py's own parser unchanged. A
Sentinel URL names the sentinels, the master's service name and the database::

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?options]

Sentinels listen on 26379 unless a port is given; the user and password, if any, are the
Redis servers' (master and replicas); the options are ``sentinel_username``,
``sentinel_password`` (the sentinels' own login, when they require one),
``sentinel_timeout`` (seconds to wait on a sentinel, 1 by default), ``socket_timeout`` and
``socket_connect_timeout`` (seconds, for the Redis servers, as in redis-py's URLs). The
client it makes asks the sentinels for the master before it connects and again after any
connection error or a ``READONLY`` reply from a demoted master, so it follows a failover
without a restart; what fails meanwhile reaches callers as redis-py errors, which
:mod:`sluicegate.store` translates. Parsing is pure; a URL that cannot be read is a
:class:`~sluicegate.errors.ConfigError` naming what is wrong, never echoing a password.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import RedisError

from sluicegate.errors import ConfigError

SENTINEL_SCHEME = "redis+sentinel"
PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379
MASTER_CHECK_S = 1.0  # how often a long-lived client asks the sentinels who the master is
FORMAT = "redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]"
_LOGIN = re.compile(r"^([^:/]+://[^/?#@]*?:)[^/?#]*@")  # scheme://user: ... @
_SECRET_OPTION = re.compile(r"([?&][a-z_]*password=)[^&#]*")
OPTIONS = (
    "sentinel_username",
    "sentinel_password",
    "sentinel_timeout",
    "socket_timeout",
    "socket_connect_timeout",
)


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """A Sentinel URL, read."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    sentinel_timeout_s: float = 1.0
    socket_timeout_s: float | None = None
    socket_connect_timeout_s: float | None = None

    def connection_kwargs(self) -> dict[str, Any]:
        """What each connection to the master gets (redis-py keyword arguments)."""
        out: dict[str, Any] = {"db": self.db}
        for name, value in (
            ("username", self.username),
            ("password", self.password),
            ("socket_timeout", self.socket_timeout_s),
            ("socket_connect_timeout", self.socket_connect_timeout_s),
        ):
            if value is not None:
                out[name] = value
        return out

    def sentinel_kwargs(self) -> dict[str, Any]:
        """What each connection to a sentinel gets."""
        out: dict[str, Any] = {
            "socket_timeout": self.sentinel_timeout_s,
            "socket_connect_timeout": self.sentinel_timeout_s,
        }
        if self.sentinel_username is not None:
            out["username"] = self.sentinel_username
        if self.sentinel_password is not None:
            out["password"] = self.sentinel_password
        return out


def scheme_of(url: str) -> str:
    scheme, sep, _rest = url.partition("://")
    return scheme.lower() if sep else ""


def redacted(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    url = _LOGIN.sub(r"\1***@", url, count=1)
    return _SECRET_OPTION.sub(r"\1***", url)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Read a ``redis+sentinel://`` URL; ConfigError says what is wrong with it."""
    shown = redacted(url)
    if scheme_of(url) != SENTINEL_SCHEME:
        raise ConfigError(f"redis_url {shown!r} is not a Sentinel URL; expected {FORMAT}")
    rest = url.partition("://")[2]
    netloc, cut, tail = _split_netloc(rest)
    path, _q, query = (cut + tail).split("#", 1)[0].partition("?")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if not colon and username is not None:
            raise ConfigError(
                f"redis_url {shown!r}: a login is 'user:password@' or ':password@', "
                f"not a user alone; expected {FORMAT}"
            )
    sentinels = tuple(_host(part, shown) for part in hostlist.split(","))
    parts = path.split("/")
    if len(parts) < 2 or not parts[1]:
        raise ConfigError(
            f"redis_url {shown!r} names no master service after the sentinels (e.g. "
            f"'/mymaster' or '/mymaster/0'); expected {FORMAT}"
        )
    if len(parts) > 3 or (len(parts) == 3 and parts[2] == ""):
        raise ConfigError(
            f"redis_url {shown!r}: the path is /service[/db], got {path!r}; expected {FORMAT}"
        )
    service = unquote(parts[1])
    db = 0
    if len(parts) == 3:
        if not parts[2].isdigit():
            raise ConfigError(
                f"redis_url {shown!r}: database {parts[2]!r} is not a number (0, 1, ...)"
            )
        db = int(parts[2])
    options = _options(query, shown)
    return SentinelUrl(
        sentinels,
        service,
        db,
        username,
        password,
        options.get("sentinel_username"),
        options.get("sentinel_password"),
        _seconds(options, "sentinel_timeout", shown) or 1.0,
        _seconds(options, "socket_timeout", shown),
        _seconds(options, "socket_connect_timeout", shown),
    )


def _split_netloc(rest: str) -> tuple[str, str, str]:
    """Split what follows ``scheme://`` into the authority, the character that ends it
    ('/', '?' or '#'; '' for none) and what follows that."""
    for i, char in enumerate(rest):
        if char in "/?#":
            return rest[:i], char, rest[i + 1 :]
    return rest, "", ""


def _host(part: str, shown: str) -> tuple[str, int]:
    if not part:
        raise ConfigError(
            f"redis_url {shown!r} lists an empty sentinel (host[:port], comma-separated); "
            f"expected {FORMAT}"
        )
    if part.startswith("["):  # [IPv6]:port
        host, bracket, after = part[1:].partition("]")
        if not bracket or not host or (after and not after.startswith(":")):
            raise ConfigError(f"redis_url {shown!r}: sentinel {part!r} is not [ipv6]:port")
        port_text = after[1:] if after else ""
    else:
        host, _colon, port_text = part.partition(":")
        if not host or ":" in port_text:
            raise ConfigError(
                f"redis_url {shown!r}: sentinel {part!r} is not host[:port] (an IPv6 address "
                "goes in brackets: [::1]:26379)"
            )
    if not port_text:
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(
            f"redis_url {shown!r}: sentinel {part!r} has port {port_text!r}; "
            "expected a number from 1 to 65535"
        )
    return host, int(port_text)


def _options(query: str, shown: str) -> dict[str, str]:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise ConfigError(f"redis_url {shown!r}: options cannot be read: {exc}") from exc
    out: dict[str, str] = {}
    for name, value in pairs:
        if name not in OPTIONS:
            raise ConfigError(
                f"redis_url {shown!r}: unknown option {name!r}; known: {', '.join(OPTIONS)}"
            )
        if name in out:
            raise ConfigError(f"redis_url {shown!r}: option {name!r} is given twice")
        out[name] = value
    return out


def _seconds(options: dict[str, str], name: str, shown: str) -> float | None:
    text = options.get(name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(
            f"redis_url {shown!r}: {name}={text!r} is not a number of seconds above 0"
        )
    return value


def _plain(url: str) -> None:
    if scheme_of(url) not in PLAIN_SCHEMES:
        known = ", ".join(f"{s}://" for s in (*PLAIN_SCHEMES, SENTINEL_SCHEME))
        raise ConfigError(f"redis_url {redacted(url)!r} has an unknown scheme; known: {known}")


class FollowingPool(redis.asyncio.sentinel.SentinelConnectionPool):
    """redis-py's pool of connections to the master, which also asks the sentinels who the
    master is every :data:`MASTER_CHECK_S` (in the background, off any command's path) and
    drops a connection to any other server before handing it out.

    redis-py alone asks only when a connection fails. After a planned failover the old
    master stays up and goes on taking writes for as long as it is not demoted (about 10 s:
    the sentinels reconfigure it on their next look at it), and the promoted master never
    gets them; a long-lived client must not spend those seconds writing into the void."""

    _next_check = 0.0
    _checking: asyncio.Future[None] | None = None

    async def get_connection(self, *args: Any, **kwargs: Any) -> AbstractConnection:
        self.check_when_due()
        got = await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        assert isinstance(got, AbstractConnection)
        return got

    def check_when_due(self) -> None:
        """Ask the sentinels who the master is, in the background, if it is time to."""
        now = time.monotonic()
        if now >= self._next_check and (self._checking is None or self._checking.done()):
            self._next_check = now + MASTER_CHECK_S
            self._checking = asyncio.ensure_future(self._check())

    def goes_to_master(self, connection: AbstractConnection) -> bool:
        """Whether ``connection`` goes to the master the sentinels named last (yes while
        none is known). A connection held outside the pool (:mod:`sluicegate.redis_lane`)
        asks this before each use."""
        master = self.master_address
        server = (getattr(connection, "host", None), getattr(connection, "port", None))
        return master is None or server == master

    async def _check(self) -> None:
        # A new master: the idle connections are dropped (redis-py's get_master_address).
        # None known now (sentinels away, a failover under way): the connections held go
        # on as they are, and a failing one asks again when it reconnects.
        with contextlib.suppress(RedisError, OSError):
            await self.get_master_address()  # type: ignore[no-untyped-call]

    async def ensure_connection(self, connection: AbstractConnection) -> None:
        if connection.is_connected and not self.goes_to_master(connection):
            await connection.disconnect()  # it reconnects to the master now known
        await super().ensure_connection(connection)

    def stop_checking(self) -> None:
        if self._checking is not None:
            self._checking.cancel()


class SentinelRedis(redis.asyncio.Redis):
    """An asyncio client of the master a Sentinel names; closing it also closes its
    connections to the sentinels."""

    watchers: tuple[redis.asyncio.Redis, ...] = ()  # the clients of the sentinels

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        pool = self.connection_pool
        if isinstance(pool, FollowingPool):
            pool.stop_checking()
        await super().aclose(close_connection_pool)
        for client in self.watchers:
            await client.aclose()


class SyncSentinelRedis(redis.Redis):
    """A blocking client of the master a Sentinel names; closing it also closes its
    connections to the sentinels."""

    watchers: tuple[redis.Redis, ...] = ()  # the clients of the sentinels

    def close(self) -> None:
        super().close()
        for client in self.watchers:
            client.close()


def async_client(url: str, **kwargs: Any) -> redis.asyncio.Redis:
    """An asyncio Redis client for ``url`` (plain or Sentinel); ``kwargs`` as redis-py's
    (e.g. ``socket_timeout``), applied to the connections to Redis itself."""
    if scheme_of(url) != SENTINEL_SCHEME:
        _plain(url)
        try:
            return redis.asyncio.Redis.from_url(url, **kwargs)
        except ValueError as exc:
            raise ConfigError(f"redis_url {redacted(url)!r}: {exc}") from exc
    parsed = parse_sentinel_url(url)
    sentinel = redis.asyncio.sentinel.Sentinel(
        list(parsed.sentinels), sentinel_kwargs=parsed.sentinel_kwargs()
    )
    client = sentinel.master_for(
        parsed.service,
        redis_class=SentinelRedis,
        connection_pool_class=FollowingPool,
        **(parsed.connection_kwargs() | kwargs),
    )
    assert isinstance(client, SentinelRedis)
    client.watchers = tuple(sentinel.sentinels)
    return client


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking Redis client for ``url``, as :func:`async_client` makes asyncio ones."""
    if scheme_of(url) != SENTINEL_SCHEME:
        _plain(url)
        try:
            return redis.Redis.from_url(url, **kwargs)
        except ValueError as exc:
            raise ConfigError(f"redis_url {redacted(url)!r}: {exc}") from exc
    parsed = parse_sentinel_url(url)
    sentinel = redis.sentinel.Sentinel(
        list(parsed.sentinels), sentinel_kwargs=parsed.sentinel_kwargs()
    )
    client = sentinel.master_for(
        parsed.service, redis_class=SyncSentinelRedis, **(parsed.connection_kwargs() | kwargs)
    )
    assert isinstance(client, SyncSentinelRedis)
    client.watchers = tuple(sentinel.sentinels)
    return client
