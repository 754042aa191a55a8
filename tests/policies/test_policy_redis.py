"""Redis backends against a real redis-server: replay caches and audit streams."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import redis
import redis.asyncio
from policy_testkit import EXAMPLE, NOW, key
from typer.testing import CliRunner

from policies import audit, redis_stores
from policies.audit import AsyncAuditWriter, AuditWriter, entry_digest, verify_chain
from policies.cli import app
from policies.errors import AuditConflict, AuditError, TokenReplayed
from policies.loader import load_policy
from policies.redis_stores import (
    AsyncRedisReplayCache,
    AsyncRedisStreamAuditStore,
    RedisReplayCache,
    RedisStreamAuditStore,
    audit_stream_key,
)
from policies.replay import acheck_replay, acheck_replays, check_replay
from policies.tokens import PlacementClaims, mint, payload_digest, verify

pytestmark = pytest.mark.integration

POLICY = load_policy(EXAMPLE)
BROKER = key("broker-1")
TRUSTED = {BROKER.public}


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest_asyncio.fixture
async def aclient(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    c = redis.asyncio.Redis.from_url(redis_url)
    yield c
    await c.aclose()


def _claims(job: str) -> PlacementClaims:
    token = mint(
        POLICY,
        BROKER,
        job_id=job,
        payload_sha256=payload_digest(job.encode()),
        data_class="wafer-image",
        origin_zone="campus/fab-north/line-1",
        target_worker="north-gpu-1",
        now=NOW,
    )
    return verify(
        token,
        POLICY,
        now=NOW,
        job_id=job,
        payload_sha256=payload_digest(job.encode()),
        worker_id="north-gpu-1",
    )


def test_redis_replay_cache_refuses_a_replay_and_expires(client: redis.Redis, unique: str) -> None:
    cache = RedisReplayCache(client, prefix=f"{unique}:nonce:")
    claims = _claims("job-1")
    check_replay(cache, claims, POLICY, now=NOW)
    with pytest.raises(TokenReplayed):
        check_replay(cache, claims, POLICY, now=NOW + 1)
    # A second worker process sharing the Redis sees the nonce too.
    with pytest.raises(TokenReplayed):
        check_replay(RedisReplayCache(client, prefix=f"{unique}:nonce:"), claims, POLICY, now=NOW)
    ttl = client.pttl(f"{unique}:nonce:{claims.nonce.hex()}")
    assert 30_000 < ttl <= 35_000  # token lifetime plus skew, measured from `now`
    assert cache.claim(b"gone", until=NOW - 5, now=NOW)  # already expired: kept 1 ms
    time.sleep(0.01)  # let the 1 ms expiry pass in Redis
    assert cache.claim(b"gone", until=NOW + 5, now=NOW)


@pytest.mark.asyncio
async def test_async_redis_replay_cache(aclient: redis.asyncio.Redis, unique: str) -> None:
    cache = AsyncRedisReplayCache(aclient, prefix=f"{unique}:nonce:")
    claims = _claims("job-2")
    await acheck_replay(cache, claims, POLICY, now=NOW)
    with pytest.raises(TokenReplayed):
        await acheck_replay(cache, claims, POLICY, now=NOW)


@pytest.mark.asyncio
async def test_async_redis_replay_cache_claims_a_batch(
    aclient: redis.asyncio.Redis, unique: str
) -> None:
    """One pipelined round trip: each nonce claimed once, whether it was seen before or
    earlier in the same batch."""
    cache = AsyncRedisReplayCache(aclient, prefix=f"{unique}:nonce:")
    seen, fresh, other = _claims("job-3"), _claims("job-4"), _claims("job-5")
    await acheck_replay(cache, seen, POLICY, now=NOW)
    found = await acheck_replays(cache, [fresh, seen, other, fresh], POLICY, now=NOW)
    assert [f is None for f in found] == [True, False, True, False]
    assert all(isinstance(f, TokenReplayed) for f in (found[1], found[3]))
    assert seen.nonce.hex() in str(found[1])
    (again,) = await acheck_replays(cache, [other], POLICY, now=NOW)
    assert isinstance(again, TokenReplayed)


def test_audit_stream_chain_batches_and_conflicts(
    client: redis.Redis, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_stores, "_BATCH", 3)
    stream = audit_stream_key(f"broker-1:{unique}")
    assert stream == f"sluicegate:audit:broker-1:{unique}"
    store = RedisStreamAuditStore(client, stream)
    assert store.last() is None
    first, second = AuditWriter(store, BROKER), AuditWriter(store, BROKER)
    second.append("decision", {"job": "j0"}, now=NOW)
    for i in range(1, 4):
        first.append("decision", {"job": f"j{i}"}, now=NOW + i)
    # `second` has a stale head: its append conflicts, it re-reads the head and retries.
    record = second.append("refusal", {"reason": "token.replayed"}, now=NOW + 9)
    assert record.seq == 4
    first.append("decision", {"job": "j5"}, now=NOW + 10)
    summary = verify_chain(store.entries(), TRUSTED)
    assert summary.count == 6
    assert client.xlen(stream) == 6
    assert next(entry_id for entry_id, _ in client.xrange(stream)) == b"1-0"
    stale = AuditWriter(store, BROKER, retries=0)
    stale._head, stale._loaded = None, True
    with pytest.raises(AuditConflict, match="another writer appended"):
        stale.append("decision", {}, now=NOW)


def test_audit_stream_tampering_is_detected(
    client: redis.Redis, redis_url: str, unique: str
) -> None:
    stream = f"{unique}:audit"
    store = RedisStreamAuditStore(client, stream)
    writer = AuditWriter(store, BROKER)
    for i in range(5):
        writer.append("decision", {"job": f"j{i}"}, now=NOW)
    client.xdel(stream, "3-0")  # delete record 2
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "audit-verify",
            "--redis-url",
            redis_url,
            "--stream",
            stream,
            "--policy",
            str(EXAMPLE),
        ],
    )
    assert result.exit_code == 1
    assert "record 2: has seq 3, expected 2" in result.output


def test_audit_stream_cli_ok_and_redis_errors(
    client: redis.Redis, redis_url: str, unique: str
) -> None:
    stream = f"{unique}:audit"
    AuditWriter(RedisStreamAuditStore(client, stream), BROKER).append("decision", {}, now=NOW)
    result = CliRunner().invoke(
        app,
        ["audit-verify", "--redis-url", redis_url, "--stream", stream, "--policy", str(EXAMPLE)],
    )
    assert result.exit_code == 0
    assert result.output.startswith("OK 1 records")
    client.set(f"{unique}:string", b"x")
    with pytest.raises(AuditError, match="Redis refused record 0") as info:
        RedisStreamAuditStore(client, f"{unique}:string").append(0, b"{}")
    assert not isinstance(info.value, AuditConflict)


@pytest.mark.asyncio
async def test_async_audit_stream_writer(
    aclient: redis.asyncio.Redis, client: redis.Redis, unique: str
) -> None:
    stream = f"{unique}:audit"
    store = AsyncRedisStreamAuditStore(aclient, stream)
    assert await store.last() is None
    first, second = AsyncAuditWriter(store, BROKER), AsyncAuditWriter(store, BROKER)
    await second.append("decision", {"job": "a"}, now=NOW)
    await first.append("decision", {"job": "b"}, now=NOW)
    assert (await second.append("refusal", {"job": "c"}, now=NOW)).seq == 2
    assert verify_chain(RedisStreamAuditStore(client, stream).entries(), TRUSTED).count == 3
    head = verify_chain(await store.read(0, 2), TRUSTED)
    assert head.count == 2
    assert verify_chain(await store.read(2, 10), TRUSTED, after=head).count == 3
    assert await store.read(3, 10) == []
    stale = AsyncAuditWriter(store, BROKER, retries=0)
    stale._head, stale._loaded = None, True
    with pytest.raises(AuditConflict):
        await stale.append("decision", {}, now=NOW)
    client.set(f"{unique}:string", b"x")
    with pytest.raises(AuditError, match="Redis refused"):
        await AsyncRedisStreamAuditStore(aclient, f"{unique}:string").append(0, b"{}")


@pytest.mark.asyncio
async def test_async_writer_keeps_the_digests_of_what_it_stored(
    aclient: redis.asyncio.Redis, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each record it stored, as stored; only its own (not another writer's), forgotten
    once verified, and never more than about ``WITNESS_MOST``, the newest kept."""
    monkeypatch.setattr(audit, "WITNESS_MOST", 4)
    store = AsyncRedisStreamAuditStore(aclient, f"{unique}:audit")
    mine, other = AsyncAuditWriter(store, BROKER), AsyncAuditWriter(store, BROKER)
    await mine.append("decision", {"job": "a"}, now=NOW)
    await other.append("decision", {"job": "b"}, now=NOW)
    await mine.append("decision", {"job": "c"}, now=NOW)
    stored = await store.read(0, 10)
    assert mine.witnessed == {0: entry_digest(stored[0]), 2: entry_digest(stored[2])}
    mine.forget(1)
    assert list(mine.witnessed) == [2]
    for i in range(4):
        await mine.append("decision", {"job": f"d{i}"}, now=NOW)
    assert list(mine.witnessed) == [4, 5, 6]  # past 4: the newest half and the one after
