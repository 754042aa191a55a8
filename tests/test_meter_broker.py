"""The broker's own export, end to end: a campus's records shipped to a real broker intake
(``broker.metering.UsageIngest`` on a real Redis, over the in-memory transport), countersigned
and exported by it, verify offline and settle as the nodes wrote them; the same export with
a record removed by hand does not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from typer.testing import CliRunner

from broker.metering import UsageIngest
from sluicegate import topics
from sluicegate.app.cli import app
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.metering.report import overall, settle
from sluicegate.metering.verify import verify_export
from sluicegate.metering.wire import encode_batch
from sluicegate.transport import Message
from tests.meter_kit import MINUTE, T0, day, meter_policy, new_intake, write_policy
from tests.support import until

pytestmark = pytest.mark.integration

POLICY = meter_policy()


@pytest.fixture
async def intake(
    fresh_redis_db: Callable[[], str],
) -> AsyncIterator[tuple[MemoryBroker, UsageIngest]]:
    client = aioredis.Redis.from_url(fresh_redis_db())
    broker = MemoryBroker()
    ingest, _metrics, transport = new_intake("broker-1", broker, client, POLICY)
    await transport.subscribe(topics.usage_all(), ingest.on_usage, qos=1)
    task = asyncio.create_task(ingest.run())
    try:
        yield broker, ingest
    finally:
        task.cancel()
        await client.aclose()


async def test_the_brokers_export_verifies_and_settles(
    intake: tuple[MemoryBroker, UsageIngest], tmp_path: Path
) -> None:
    broker, ingest = intake
    records = [s.model_copy(update={"receipt": None}) for s in day().records]  # as shipped
    nodes = sorted({s.record.node for s in records})
    for node in nodes:
        mine = [s for s in records if s.record.node == node]
        MemoryTransport(broker).publish_nowait(
            Message(topics.usage(node), encode_batch(mine), qos=1)
        )
    await until(lambda: ingest.stored == len(records))
    body = await ingest.export(T0, T0 + 60 * MINUTE)

    checked = verify_export(body, POLICY)
    assert checked.ok, checked.problems
    assert len(checked.records) == 13
    s = settle(checked.records, POLICY)
    assert (overall(s).jobs, str(overall(s).device_s)) == (5, "0.146000")
    assert (overall(s).waste_attempts, len(s.unsettled)) == (3, 1)

    export = tmp_path / "usage.jsonl"
    export.write_bytes(body)
    policy = write_policy(tmp_path)
    done = CliRunner().invoke(app, ["meter", "verify", str(export), "--policy", str(policy)])
    assert done.exit_code == 0, done.output
    lines = body.split(b"\n")
    del lines[3]
    export.write_bytes(b"\n".join(lines))
    done = CliRunner().invoke(app, ["meter", "verify", str(export), "--policy", str(policy)])
    assert done.exit_code == 1
    assert "removed" in done.output
