"""Real Redis: the broker's periodic audit-chain check. Incremental passes cover new records
only, the verified head is re-read each pass (a log cut back or rewritten fails), a pass
from the first record finds an edit deep in the log, and an unreachable Redis makes the
verification old without counting the chain as broken. Records the process's own writer
stored are checked against the digests it kept, and an edit to one is still found."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import redis
import redis.asyncio

from broker.audit_check import AuditChecker, trusted_keys
from broker.metrics import BrokerMetrics
from policies.audit import AsyncAuditWriter, AuditRecord, decode_record, next_record
from policies.keys import SigningKey
from policies.redis_stores import AsyncRedisStreamAuditStore, RedisStreamAuditStore
from sluicegate.app.servers import free_port
from tests.policies.policy_testkit import NOW, key

pytestmark = pytest.mark.integration

BROKER = key("broker-1")


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


def chain(n: int, signer: SigningKey = BROKER, *, tag: str = "a") -> list[AuditRecord]:
    out: list[AuditRecord] = []
    for i in range(n):
        head = out[-1] if out else None
        out.append(next_record(head, "decision", {"job": f"{tag}-{i}"}, now=NOW + i, key=signer))
    return out


def write(client: redis.Redis, stream: str, records: list[AuditRecord], start: int = 0) -> None:
    store = RedisStreamAuditStore(client, stream)
    for record in records[start:]:
        store.append(record.seq, record.encode())


def sample(m: BrokerMetrics, name: str) -> float | None:
    return m.registry.get_sample_value(name)


def checker(
    aclient: redis.asyncio.Redis,
    stream: str,
    writer: AsyncAuditWriter | None = None,
    **kw: float,
) -> AuditChecker:
    store = AsyncRedisStreamAuditStore(aclient, stream)
    clock = iter(range(1_000_000, 2_000_000, 10))
    return AuditChecker(
        store,
        lambda: trusted_keys(BROKER.public, None),
        BrokerMetrics(),
        chunk=1000,
        clock=lambda: float(next(clock)),
        writer=writer,
        **kw,
    )


async def test_new_records_are_verified_incrementally_and_the_head_shown(
    client: redis.Redis, aclient: redis.asyncio.Redis, unique: str
) -> None:
    stream = f"{unique}:audit"
    c = checker(aclient, stream)
    first = await c.check()
    assert (first.ok, first.records, first.head) == (True, 0, None)
    records = chain(2503)
    write(client, stream, records[:2500])
    got = await c.check()
    assert (got.ok, got.records, got.head, got.error) == (
        True,
        2500,
        records[2499].hash.hex(),
        None,
    )
    assert got.verified_at is not None
    write(client, stream, records, start=2500)
    again = await c.check()
    assert (again.records, again.head) == (2503, records[-1].hash.hex())
    assert again.verified_at is not None
    assert again.verified_at > got.verified_at
    m = c._metrics
    assert sample(m, "sluicegate_audit_chain_records") == 2503
    assert sample(m, "sluicegate_audit_verified_timestamp_seconds") == again.verified_at
    assert sample(m, "sluicegate_audit_verify_failures_total") == 0
    assert c.plain() == {
        "head": records[-1].hash.hex(),
        "records": 2503,
        "verified_at": again.verified_at,
        "ok": True,
        "error": None,
    }


async def test_a_log_rewritten_at_its_head_fails_and_is_counted(
    client: redis.Redis, aclient: redis.asyncio.Redis, unique: str
) -> None:
    stream = f"{unique}:audit"
    write(client, stream, chain(5))
    c = checker(aclient, stream)
    good = await c.check()
    client.delete(stream)
    write(client, stream, chain(5, tag="forged"))  # same length, another history
    bad = await c.check()
    assert not bad.ok
    assert bad.error is not None
    assert "truncated" in bad.error
    assert (bad.records, bad.head, bad.verified_at) == (5, good.head, good.verified_at)
    assert sample(c._metrics, "sluicegate_audit_verify_failures_total") == 1
    client.delete(stream)
    write(client, stream, chain(3))  # cut back
    assert not (await c.check()).ok
    assert sample(c._metrics, "sluicegate_audit_verify_failures_total") == 2


async def test_a_full_pass_finds_an_edit_deep_in_the_log(
    client: redis.Redis, aclient: redis.asyncio.Redis, unique: str
) -> None:
    stream = f"{unique}:audit"
    records = chain(6)
    c = checker(aclient, stream, full_every_s=0.0)  # every pass from the first record
    write(client, stream, records)
    assert (await c.check()).ok
    # Rebuild the stream with record 2 edited after signing.
    client.delete(stream)
    edited = [*records]
    edited[2] = AuditRecord(**{**records[2].__dict__, "data": {"job": "other"}})
    write(client, stream, edited)
    found = await c.check()
    assert not found.ok
    assert found.error is not None
    assert "bad-signature" in found.error


async def test_the_own_writers_records_are_checked_by_digest_and_an_edit_still_found(
    client: redis.Redis, aclient: redis.asyncio.Redis, unique: str
) -> None:
    stream = f"{unique}:audit"
    writer = AsyncAuditWriter(AsyncRedisStreamAuditStore(aclient, stream), BROKER)
    c = checker(aclient, stream, writer)
    for i in range(5):
        await writer.append("decision", {"job": f"a-{i}"}, now=NOW + i)
    assert (await c.check()).records == 5  # the first pass: every signature
    assert writer.witnessed == {}  # verified: forgotten
    for i in range(3):
        await writer.append("decision", {"job": f"b-{i}"}, now=NOW + i)
    assert sorted(writer.witnessed) == [5, 6, 7]
    stored = [decode_record(e) for e in RedisStreamAuditStore(client, stream).entries()]
    client.delete(stream)
    edited = [*stored]
    edited[6] = AuditRecord(**{**stored[6].__dict__, "data": {"job": "other"}})
    write(client, stream, edited)
    found = await c.check()
    assert not found.ok
    assert found.error is not None
    assert "bad-signature" in found.error
    assert found.records == 5
    client.delete(stream)
    write(client, stream, stored)  # as the writer stored it: verifies
    assert (await c.check()).records == 8
    assert writer.witnessed == {}


async def test_a_record_signed_by_an_untrusted_key_fails(
    client: redis.Redis, aclient: redis.asyncio.Redis, unique: str
) -> None:
    stream = f"{unique}:audit"
    write(client, stream, chain(2, key("mallory")))
    found = await checker(aclient, stream).check()
    assert not found.ok
    assert found.error is not None
    assert "untrusted" in found.error.lower()


async def test_an_unreachable_redis_ages_the_verification_without_a_failure() -> None:
    dead = redis.asyncio.Redis(port=free_port(), socket_connect_timeout=0.5)
    try:
        c = checker(dead, "audit")
        found = await c.check()
    finally:
        await dead.aclose()
    assert not found.ok
    assert found.error is not None
    assert found.error.startswith("not verified")
    assert found.verified_at is None
    assert sample(c._metrics, "sluicegate_audit_verify_failures_total") == 0
    assert sample(c._metrics, "sluicegate_audit_verified_timestamp_seconds") == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="accepted: chunk >= 1"):
        AuditChecker(None, frozenset, BrokerMetrics(), chunk=0)  # type: ignore[arg-type]
