"""In-memory tier: a metered pool worker (real model, real ledger file, the in-memory
transport). Each attempt that ran gets one signed record, on disk before its result goes
out, naming the job, token, line, owner, model file, device class, its share of the
device time, the bytes in and the digest of the result sent; what never ran gets none; a
ledger that cannot write delays nothing forever: the result goes out, counted unmetered."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest_asyncio

from center_pool.guard import AuditSink, MemoryAsyncReplayCache, MemoryAuditStore
from center_pool.hardware import HostProbe
from center_pool.worker import PoolWorker
from policies import AsyncAuditWriter, SigningKey, mint, payload_digest
from sluicegate import topics
from sluicegate.config import PoolSettings
from sluicegate.errors import LedgerError
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.metering.ledger import Ledger
from sluicegate.metering.meter import Meter
from sluicegate.metering.record import SignedUsage, Usage
from sluicegate.metering.wire import decode_batch
from sluicegate.policy_feed import PolicyFeed
from sluicegate.transport import Message
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from tests.pool_kit import (
    BROKER,
    DATA_CLASS,
    EDGE,
    JPEG,
    ORIGIN,
    POLICY,
    WORKER,
    WORKER_ZONE,
    WorkSpec,
    envelope,
    pin,
)
from tests.support import until

REGISTRY = ModelRegistry.from_dir(default_models_dir())
RESULTS = topics.edge_returns(EDGE, WORKER)
KEY = SigningKey.generate()


class HeldMeter(Meter):
    """Its records are written only when the test says so (``release``), or fail."""

    def __init__(self, ledger: Ledger, transport: MemoryTransport) -> None:
        super().__init__(ledger, transport)
        self.held: list[tuple[Sequence[Usage], asyncio.Future[list[SignedUsage]]]] = []

    def record(self, drafts: Sequence[Usage]) -> asyncio.Future[list[SignedUsage]]:
        fut: asyncio.Future[list[SignedUsage]] = asyncio.get_running_loop().create_future()
        self.held.append((drafts, fut))
        return fut

    async def release(self) -> None:
        for drafts, fut in self.held:
            fut.set_result(await super().record(drafts))
        self.held.clear()

    def fail(self) -> None:
        for _drafts, fut in self.held:
            fut.set_exception(LedgerError("usage ledger x cannot be written (disk I/O error)"))
        self.held.clear()


@dataclass
class Pool:
    broker: MemoryBroker
    worker: PoolWorker
    meter: Meter
    stop: asyncio.Event
    runner: asyncio.Future[None]

    def results(self) -> list[Message]:
        return [m for m in self.broker.log if m.topic == RESULTS]


async def _start(tmp_path: Path, *, held: bool = False) -> Pool:
    broker = MemoryBroker()
    MemoryTransport(broker).publish_nowait(Message(topics.policy(), envelope(), qos=1, retain=True))
    settings = PoolSettings(id=WORKER, zone=WORKER_ZONE, telemetry_interval_s=0.05)
    feed = PolicyFeed(node=WORKER, state_dir=pin(tmp_path / "state"))
    feed.load()
    transport = MemoryTransport(broker)
    ledger = Ledger(tmp_path / "usage.sqlite", KEY, node=WORKER, kind="pool")
    meter = HeldMeter(ledger, transport) if held else Meter(ledger, transport)
    worker = PoolWorker(
        settings,
        transport,
        REGISTRY,
        feed=feed,
        replay=MemoryAsyncReplayCache(),
        audit=AuditSink(AsyncAuditWriter(MemoryAuditStore(), KEY)),
        probe=HostProbe(),
        providers=["CPUExecutionProvider"],
        meter=meter,
    )
    stop = asyncio.Event()
    runner = asyncio.ensure_future(worker.run(stop, policy_wait=0.2))
    await asyncio.wait_for(worker.ready.wait(), 10)
    return Pool(broker, worker, meter, stop, runner)


@pytest_asyncio.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Pool]:
    started = await _start(tmp_path)
    yield started
    started.stop.set()
    await asyncio.wait_for(started.runner, 30)


def _work(job_id: str, *, owner: str | None = None, payload: bytes = JPEG) -> Message:
    token = mint(
        POLICY,
        BROKER,
        job_id=job_id,
        payload_sha256=payload_digest(payload),
        data_class=DATA_CLASS,
        origin_zone=ORIGIN,
        target_worker=WORKER,
        now=time.time(),
        ttl_s=10.0,
        nonce=hashlib.sha256(job_id.encode()).digest()[:16],
    )
    msg = WorkSpec(job_id=job_id, token=token, payload=payload, attempt="2").message()
    if owner is not None:
        msg = replace(msg, user_properties=(*msg.user_properties, (topics.PROP_OWNER, owner)))
    return msg


async def test_an_attempt_that_ran_is_recorded_signed_and_shipped(pool: Pool) -> None:
    pool.worker.on_message(_work("job-m1", owner="north-inspect"))
    result = await pool.broker.wait_for(lambda m: m.topic == RESULTS)
    (signed,) = await pool.meter.ledger.unacked()
    r = signed.record
    assert signed.node_signature_valid(KEY.public)
    assert (r.node, r.kind, r.seq, r.event) == (WORKER, "pool", 1, "ran")
    assert (r.job_id, r.attempt, r.token_id, r.line, r.owner) == (
        "job-m1",
        2,
        hashlib.sha256(b"job-m1").hexdigest()[:32],
        EDGE,
        "north-inspect",
    )
    assert (r.data_class, r.zone, r.model, r.device_class) == (
        DATA_CLASS,
        WORKER_ZONE,
        "defect-v1",
        "x86-cpu",
    )
    assert r.model_sha256 == REGISTRY.get("defect-v1").manifest.sha256
    assert r.backend
    assert (r.status, r.batch_size, r.bytes_in) == ("ok", 1, len(JPEG))
    assert r.result_sha256 == hashlib.sha256(result.payload).hexdigest()
    assert r.device_us > 0
    shipped = await pool.broker.wait_for(lambda m: m.topic == topics.usage(WORKER))
    assert decode_batch(shipped.payload) == [signed]
    figures = pool.worker.scrape()  # what /metrics reads
    assert (figures.usage_written, figures.unmetered, figures.usage_unacked) == (1, 0, 1)


async def test_what_never_ran_gets_no_record(pool: Pool) -> None:
    refused = WorkSpec(job_id="job-t", token="not-a-token").message()
    # an image whose header is refused after the token passed: placed, never run
    undecodable = _work("job-bad", payload=b"\xff\xd8\xff" + b"\x00" * 4000)
    for msg in (refused, undecodable):
        pool.worker.on_message(msg)
    await until(lambda: len(pool.results()) == 2, timeout=10)
    ran = _work("job-ok")
    pool.worker.on_message(ran)
    await until(lambda: len(pool.results()) == 3, timeout=10)
    await until(lambda: pool.meter.written == 1)
    assert [s.record.job_id for s in await pool.meter.ledger.unacked()] == ["job-ok"]


async def test_the_result_waits_for_its_record_on_disk(tmp_path: Path) -> None:
    started = await _start(tmp_path, held=True)
    meter = started.meter
    assert isinstance(meter, HeldMeter)
    try:
        started.worker.on_message(_work("job-h1"))
        await until(lambda: meter.held, timeout=10)
        assert started.results() == []  # not before its record is durable
        await meter.release()
        await until(lambda: len(started.results()) == 1)
        assert [s.record.job_id for s in await meter.ledger.unacked()] == ["job-h1"]
        started.worker.on_message(_work("job-h2"))
        await until(lambda: meter.held, timeout=10)
        meter.fail()  # the disk failed: the result still goes, the job counted unmetered
        await until(lambda: len(started.results()) == 2)
        assert started.worker.unmetered == 1
    finally:
        started.stop.set()
        await asyncio.wait_for(started.runner, 30)
