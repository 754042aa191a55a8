"""The broker's usage intake on a real Redis, over the in-memory transport: two replicas that
each hear every record store it once, countersigned, and both acknowledge; a resend is a
duplicate, a different record for a held seq a conflict kept aside; forged, altered,
foreign and malformed records are refused with a reason and never stored; gaps are
counted; the export's records and manifest verify."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from broker import keys
from broker.api import export_period
from sluicegate import topics
from sluicegate.app.servers import running, start_redis
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.metering.record import (
    GENESIS,
    ManifestLine,
    SignedUsage,
    from_line,
)
from sluicegate.metering.wire import UsageAck, encode_batch
from sluicegate.transport import Message
from tests.meter_kit import new_intake, pool_chain
from tests.policies.policy_testkit import base_doc, key, policy_of
from tests.support import until

pytestmark = pytest.mark.integration

POLICY = policy_of(base_doc())
NODE = "north-gpu-1"


def _chain(
    n: int, *, start: int = 1, prev: bytes = GENESIS, signer: str = NODE
) -> list[SignedUsage]:
    return pool_chain(NODE, n, start=start, prev=prev, signer=signer)


class Replica:
    def __init__(self, name: str, broker: MemoryBroker, client: aioredis.Redis) -> None:
        self.ingest, self.metrics, self.transport = new_intake(name, broker, client, POLICY)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.transport.subscribe(topics.usage_all(), self.ingest.on_usage, qos=1)
        self.task = asyncio.create_task(self.ingest.run())

    def value(self, name: str, **labels: str) -> float:
        got = self.metrics.registry.get_sample_value(name, labels or None)
        return got or 0.0


@pytest.fixture
async def campus(
    fresh_redis_db: Callable[[], str],
) -> AsyncIterator[tuple[MemoryBroker, list[Replica], aioredis.Redis]]:
    client = aioredis.Redis.from_url(fresh_redis_db())
    broker = MemoryBroker()
    replicas = [Replica("broker-1", broker, client), Replica("broker-2", broker, client)]
    for replica in replicas:
        await replica.start()
    yield broker, replicas, client
    for replica in replicas:
        assert replica.task is not None
        replica.task.cancel()
    await client.aclose()


def _acks(broker: MemoryBroker, node: str = NODE) -> list[UsageAck]:
    return [
        UsageAck.model_validate_json(m.payload)
        for m in broker.log
        if m.topic == topics.usage_acks(node)
    ]


def _ship(
    broker: MemoryBroker, records: list[SignedUsage], node: str = NODE, extra: bytes = b""
) -> None:
    MemoryTransport(broker).publish_nowait(
        Message(topics.usage(node), encode_batch(records) + extra, qos=1)
    )


async def test_two_replicas_store_each_record_once_and_both_acknowledge(campus: Any) -> None:
    broker, replicas, client = campus
    records = _chain(3)
    _ship(broker, records)
    await until(lambda: len(_acks(broker)) == 2)
    assert all(sorted(a.held) == [1, 2, 3] and not a.refused for a in _acks(broker))
    assert sum(r.ingest.stored for r in replicas) == 3
    held = await client.hgetall(keys.usage_records(NODE))
    assert sorted(int(k) for k in held) == [1, 2, 3]
    stored = {int(k): from_line(bytes(v)[128:]) for k, v in held.items()}
    for seq, signed in stored.items():
        assert signed.record == records[seq - 1].record
        assert signed.node_signature_valid(key(NODE).public)
        assert signed.receipt is not None
        assert signed.receipt_valid(key(signed.receipt.broker).public)
    device = sum(
        r.value("sluicegate_usage_device_seconds_total", line="north-l1-pc", pool="north-dc")
        for r in replicas
    )
    assert device == pytest.approx(0.006)

    _ship(broker, records[1:2])  # a resend: duplicates, acknowledged again, stored once
    await until(lambda: len(_acks(broker)) == 4)
    assert [a.held for a in _acks(broker)[2:]] == [[2], [2]]
    # each record of the first message was a duplicate at one replica, the resend at both
    assert sum(r.value("sluicegate_usage_duplicates_total") for r in replicas) == 3 + 2
    assert sum(r.ingest.stored for r in replicas) == 3


async def test_a_different_record_for_a_held_seq_is_a_conflict_kept_aside(campus: Any) -> None:
    broker, replicas, client = campus
    _ship(broker, _chain(2))
    await until(lambda: len(_acks(broker)) == 2)
    before = await client.hget(keys.usage_records(NODE), "2")
    other = _chain(1, start=2, prev=b"\x01" * 32)  # signed by the node, another record
    _ship(broker, other)
    await until(lambda: len(_acks(broker)) == 4)
    for ack in _acks(broker)[2:]:
        assert ack.held == []
        assert [(r.seq, r.code) for r in ack.refused] == [(2, "usage.conflict")]
    assert await client.hget(keys.usage_records(NODE), "2") == before
    kept = await client.hgetall(keys.usage_conflicts(NODE))
    assert [from_line(line).record for line in kept.values()] == [other[0].record]
    assert sum(r.value("sluicegate_usage_conflicts_total", node=NODE) for r in replicas) == 1


async def test_forged_altered_foreign_and_malformed_records_are_refused(campus: Any) -> None:
    broker, replicas, client = campus
    good = _chain(2)
    forged = _chain(1, start=3, prev=good[-1].digest(), signer="south-npu-1")[0]
    altered = good[1].model_copy(
        update={"record": good[1].record.model_copy(update={"device_us": 1})}
    )
    _ship(broker, [good[0], altered, forged], extra=b'{"not": "a record"}\n')
    await until(lambda: len(_acks(broker)) == 2)
    for ack in _acks(broker):
        assert ack.held == [1]
        codes = sorted((r.seq, r.code) for r in ack.refused)
        assert codes == [
            (0, "usage.malformed"),
            (2, "usage.bad_signature"),
            (3, "usage.bad_signature"),
        ]
    assert sorted(await client.hkeys(keys.usage_records(NODE))) == [b"1"]
    # a record naming another node than the topic's sender
    _ship(broker, _chain(1), node="north-gpu-2")
    await until(lambda: len(_acks(broker, "north-gpu-2")) == 2)
    assert [r.code for r in _acks(broker, "north-gpu-2")[0].refused] == ["usage.id_mismatch"]
    assert (
        sum(
            r.value("sluicegate_usage_refusals_total", code="usage.bad_signature") for r in replicas
        )
        == 4
    )


async def test_gaps_are_counted_and_the_export_verifies(campus: Any) -> None:
    broker, replicas, _client = campus
    records = _chain(5)
    _ship(broker, [records[0], records[1], records[4]])
    await until(lambda: len(_acks(broker)) == 2)
    # The replica that stored a record says what the chain lacks as it stands then: which
    # of the two stored seq 5 is a race (each hears every record; Redis keeps one copy).
    missing = "sluicegate_usage_missing_records"
    await until(lambda: any(r.value(missing, node=NODE) == 2 for r in replicas))
    _ship(broker, [records[2], records[3]])
    await until(lambda: len(_acks(broker)) == 4)  # the gap filled: the export below holds it
    assert sum(r.value("sluicegate_usage_chain_breaks_total", node=NODE) for r in replicas) == 0

    body = await replicas[1].ingest.export(1_780_000_000_002, 1_780_000_000_004)
    lines = body.rstrip(b"\n").split(b"\n")
    exported = [from_line(line) for line in lines[:-1]]
    assert [s.record.seq for s in exported] == [2, 3, 4]
    assert all(s.node_signature_valid(key(NODE).public) for s in exported)
    manifest = ManifestLine.model_validate_json(lines[-1]).manifest
    assert manifest.broker == "broker-2"
    assert manifest.signature_valid(key("broker-2").public)
    assert (
        manifest.records_sha256
        == hashlib.sha256(b"".join(line + b"\n" for line in lines[:-1])).hexdigest()
    )
    assert [(h.node, h.first_seq, h.last_seq) for h in manifest.heads] == [(NODE, 2, 4)]
    assert manifest.heads[0].last_digest == records[3].digest().hex()


@pytest.mark.parametrize(
    ("start", "end", "want"),
    [
        ("1780000000", "1780000060", (1_780_000_000_000, 1_780_000_060_000)),
        ("1780000000.5", "1780000000.5", (1_780_000_000_500, 1_780_000_000_500)),
        (None, "1", "from is missing"),
        ("1", None, "to is missing"),
        ("yesterday", "1", "from='yesterday': expected unix seconds"),
        ("nan", "1", "expected unix seconds"),
        ("-5", "1", "expected unix seconds"),
        ("10", "5", "is after to"),
    ],
)
def test_the_export_period(start: str | None, end: str | None, want: Any) -> None:
    got = export_period(start, end)
    if isinstance(want, str):
        assert isinstance(got, str)
        assert want in got
    else:
        assert got == want


async def test_records_redis_could_not_take_are_not_acknowledged_and_a_resend_stores_them() -> None:
    """Redis down: nothing is acknowledged (the node keeps its records and sends them
    again), the failure is counted, and the intake goes on serving; once Redis is back the
    resend, more records than one Redis call takes, is stored and acknowledged."""
    with running(start_redis()) as server:
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{server.port}/0")
        broker = MemoryBroker()
        replica = Replica("broker-1", broker, client)
        await replica.start()
        try:
            records = _chain(150)
            await asyncio.to_thread(server.stop)
            _ship(broker, records)
            await until(lambda: replica.value("sluicegate_usage_store_failures_total") == 1, 15)
            assert _acks(broker) == []
            await asyncio.to_thread(server.start)
            _ship(broker, records)
            await until(lambda: len(_acks(broker)) == 1, 15)
            assert sorted(_acks(broker)[0].held) == list(range(1, 151))
            assert await client.hlen(keys.usage_records(NODE)) == 150
        finally:
            assert replica.task is not None
            replica.task.cancel()
            await client.aclose()
