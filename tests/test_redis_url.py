"""Pure tier: reading ``redis_url``. A Sentinel URL gives its sentinels, service, database,
logins and timeouts; anything wrong with one is a ConfigError that says what and never
shows a password; plain URLs go to redis-py as they are. Making a client connects to
nothing, so the clients here are only looked at."""

from __future__ import annotations

import asyncio

import pytest

from sluicegate.errors import ConfigError
from sluicegate.redis_url import (
    SentinelRedis,
    SentinelUrl,
    SyncSentinelRedis,
    async_client,
    parse_sentinel_url,
    redacted,
    sync_client,
)

S = "redis+sentinel://"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            f"{S}host1:26379,host2:26380/mymaster/0",
            SentinelUrl((("host1", 26379), ("host2", 26380)), "mymaster", 0),
        ),
        (f"{S}10.0.0.5/sg", SentinelUrl((("10.0.0.5", 26379),), "sg", 0)),
        (f"{S}a,b:1,c/sg/15", SentinelUrl((("a", 26379), ("b", 1), ("c", 26379)), "sg", 15)),
        (
            f"{S}[::1]:5000,[fe80::2]/sg/2",
            SentinelUrl((("::1", 5000), ("fe80::2", 26379)), "sg", 2),
        ),
        (f"{S}:s%40cret@h/sg", SentinelUrl((("h", 26379),), "sg", 0, password="s@cret")),
        (
            f"{S}app:pw@h/sg/3",
            SentinelUrl((("h", 26379),), "sg", 3, username="app", password="pw"),
        ),
        (
            f"{S}h/sg/1?sentinel_password=x&sentinel_username=watch&sentinel_timeout=0.5"
            "&socket_timeout=2&socket_connect_timeout=1.5",
            SentinelUrl(
                (("h", 26379),),
                "sg",
                1,
                sentinel_username="watch",
                sentinel_password="x",
                sentinel_timeout_s=0.5,
                socket_timeout_s=2.0,
                socket_connect_timeout_s=1.5,
            ),
        ),
        ("REDIS+SENTINEL://h/sg", SentinelUrl((("h", 26379),), "sg", 0)),
    ],
)
def test_a_sentinel_url_is_read(url: str, expected: SentinelUrl) -> None:
    assert parse_sentinel_url(url) == expected


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (f"{S}h1:26379", "names no master service"),
        (f"{S}h1:26379/", "names no master service"),
        (f"{S}h/sg/x", "database 'x' is not a number"),
        (f"{S}h/sg/-1", "database '-1' is not a number"),
        (f"{S}h/sg/0/extra", "the path is /service[/db]"),
        (f"{S}h/sg/", "the path is /service[/db]"),
        (f"{S}/sg", "empty sentinel"),
        (f"{S}h1,,h2/sg", "empty sentinel"),
        (f"{S}h:port/sg", "has port 'port'"),
        (f"{S}h:0/sg", "has port '0'"),
        (f"{S}h:65536/sg", "has port '65536'"),
        (f"{S}::1:26379/sg", "IPv6 address goes in brackets"),
        (f"{S}[::1/sg", "is not [ipv6]:port"),
        (f"{S}[::1]x/sg", "is not [ipv6]:port"),
        (f"{S}user@h/sg", "not a user alone"),
        (f"{S}h/sg?db=1", "unknown option 'db'; known: sentinel_username"),
        (f"{S}h/sg?socket_timeout=0", "socket_timeout='0' is not a number of seconds"),
        (f"{S}h/sg?sentinel_timeout=soon", "sentinel_timeout='soon' is not a number"),
        (f"{S}h/sg?socket_timeout=1&socket_timeout=2", "given twice"),
        (f"{S}h/sg?junk", "options cannot be read"),
        ("redis://h/0", "is not a Sentinel URL"),
    ],
)
def test_a_bad_sentinel_url_says_what_is_wrong(url: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("?", r"\?")):
        parse_sentinel_url(url)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"{S}:hunter2@h/sg", f"{S}:***@h/sg"),
        (f"{S}app:hunter2@h1,h2/sg/1", f"{S}app:***@h1,h2/sg/1"),
        (f"{S}h/sg?sentinel_password=hunter2&x=1", f"{S}h/sg?sentinel_password=***&x=1"),
        ("redis://:hunter2@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://app@h/0", "redis://app@h/0"),
    ],
)
def test_passwords_are_never_shown(url: str, shown: str) -> None:
    assert redacted(url) == shown


def test_a_bad_url_s_error_hides_its_password() -> None:
    with pytest.raises(ConfigError) as info:
        parse_sentinel_url(f"{S}:hunter2@h/sg/x?sentinel_password=hunter3")
    assert "hunter" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        sync_client("redis://:hunter2@h:port/0")
    assert "hunter" not in str(info.value)


@pytest.mark.parametrize("url", ["http://h/0", "h:6379", "redis+cluster://h/0", ""])
def test_an_unknown_scheme_is_refused_naming_the_known(url: str) -> None:
    with pytest.raises(ConfigError, match=r"unknown scheme; known: redis://, rediss://, unix://"):
        sync_client(url)
    with pytest.raises(ConfigError, match="unknown scheme"):
        async_client(url)


def test_plain_urls_go_to_redis_py_as_they_are() -> None:
    client = sync_client("redis://:pw@127.0.0.1:6390/4", socket_timeout=2.0)
    try:
        kwargs = client.connection_pool.connection_kwargs
        assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("127.0.0.1", 6390, 4)
        assert (kwargs["password"], kwargs["socket_timeout"]) == ("pw", 2.0)
    finally:
        client.close()
    unix = sync_client("unix:///run/redis.sock?db=2")
    try:
        assert unix.connection_pool.connection_kwargs["path"] == "/run/redis.sock"
    finally:
        unix.close()


def test_a_sentinel_url_makes_a_client_of_the_master_and_of_the_sentinels() -> None:
    url = f"{S}app:pw@s1:1,s2:2/sg/3?sentinel_password=w&socket_timeout=4"
    client = sync_client(url, socket_connect_timeout=2.0)
    try:
        assert isinstance(client, SyncSentinelRedis)
        pool = client.connection_pool
        assert pool.service_name == "sg"
        kwargs = pool.connection_kwargs
        assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (3, "app", "pw")
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (4.0, 2.0)
        watchers = [w.connection_pool.connection_kwargs for w in client.watchers]
        assert [(w["host"], w["port"]) for w in watchers] == [("s1", 1), ("s2", 2)]
        assert {w["password"] for w in watchers} == {"w"}
        assert {w["socket_timeout"] for w in watchers} == {1.0}
    finally:
        client.close()

    async def made() -> None:
        aclient = async_client(url)
        try:
            assert isinstance(aclient, SentinelRedis)
            assert aclient.connection_pool.connection_kwargs["db"] == 3
            assert len(aclient.watchers) == 2
        finally:
            await aclient.aclose()

    asyncio.run(made())
