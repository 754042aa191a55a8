"""The edge's job records for the twin's recorder: each concluded job's record made from its
job and result (pure), the bounded batch, and the agent publishing the batch with its
telemetry (in-memory transport, the real model)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import pytest

from edge_agent.admission import Job
from edge_agent.agent import EdgeAgent
from edge_agent.trace_log import TraceLog, record_of, refusal_of
from sluicegate import topics, wire
from sluicegate.config import load_settings
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.transport import Message
from sluicegate.vision.image import ImageInfo
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from tests.image_bytes import sample_jpeg

REGISTRY = ModelRegistry.from_dir(default_models_dir())
JPEG, _ = sample_jpeg(11)
T0 = 1_700_000_000.0
EDGE_ON = wire.RanOn(kind="edge", node="line-1-pc", zone="campus/line-1")
POOL_ON = wire.RanOn(kind="pool", node="north-cpu-1", zone="campus/dc")


def job(deadline_ms: float | None = 200.0) -> Job:
    return Job(
        job_id="j1",
        model="defect-v1",
        payload=b"x" * 1234,
        image=ImageInfo("jpeg", 640, 480),
        response_topic="app/results",
        correlation_data=None,
        priority=7,
        data_class="wafer-image",
        received_at=T0,
        deadline=T0 + deadline_ms / 1000.0 if deadline_ms is not None else None,
    )


def result(
    on: wire.RanOn, status: wire.Status = "ok", queue: float = 0.0, total: float = 0.0, **kw: str
) -> wire.JobResult:
    timings = wire.Timings(queue_ms=queue, total_ms=total)
    return wire.JobResult(job_id="j1", status=status, ran_on=on, timings_ms=timings, **kw)  # type: ignore[arg-type]


def test_a_job_run_here_says_so_with_its_wait_its_service_and_the_prediction() -> None:
    ran = result(EDGE_ON, queue=30.0, total=45.5)
    ran = ran.model_copy(
        update={"timings_ms": ran.timings_ms.model_copy(update={"device_ms": 12.0})}
    )
    got = record_of(
        job(),
        ran,
        left_at=T0 + 0.046,
        started=T0 + 0.030,
        sha256="ab" * 32,
        predicted=T0 + 0.040,
    )
    assert (got.ran_on, got.offloaded, got.status, got.code) == ("line-1-pc", False, "ok", None)
    # Its time on the thread, and the part the agent measured as compute.
    assert (got.queue_ms, got.service_ms, got.device_ms) == (30.0, 15.5, 12.0)
    assert got.latency_ms == pytest.approx(46.0)
    assert got.predicted_ms == pytest.approx(40.0)
    assert (got.deadline_ms, got.bytes, got.priority, got.sha256) == (200.0, 1234, 7, "ab" * 32)
    assert got.received_at == T0


def test_a_job_a_worker_ran_takes_the_workers_timings() -> None:
    got = record_of(
        job(None),
        result(POOL_ON, queue=3.0, total=12.0),
        left_at=T0 + 0.020,
        started=None,
        sha256=None,
        predicted=None,
    )
    assert (got.ran_on, got.offloaded) == ("north-cpu-1", True)
    assert (got.queue_ms, got.service_ms, got.deadline_ms, got.predicted_ms) == (3, 9, None, None)
    assert got.device_ms is None  # a worker's run teaches the edge's estimate nothing


def test_a_job_a_sister_campus_ran_names_its_worker_as_this_campus_names_it() -> None:
    there = wire.RanOn(kind="pool", node="north-cpu-1", zone="campus/fab-south/dc")
    placed = wire.Offload(requested=True, placed=True, worker="north-cpu-1@south-site")
    ran = result(there, queue=3.0, total=12.0).model_copy(update={"offload": placed})
    got = record_of(job(), ran, left_at=T0 + 0.05, started=None, sha256=None, predicted=None)
    # south's worker shares a name with one of ours: the record keeps them apart
    assert (got.ran_on, got.worker, got.offloaded) == (placed.worker, placed.worker, True)


def test_a_job_that_never_ran_names_no_node_and_keeps_the_offload_code() -> None:
    offload = wire.Offload(requested=True, placed=False, code="no_capacity")
    expired = wire.JobResult(
        job_id="j1",
        status="expired",
        code="expired",
        ran_on=EDGE_ON,
        timings_ms=wire.Timings(queue_ms=250.0, total_ms=250.0),
    )
    got = record_of(job(), expired, left_at=T0 + 0.25, started=None, sha256=None, predicted=None)
    assert (got.ran_on, got.offloaded, got.queue_ms, got.service_ms) == (None, False, 0, 0)
    assert got.code == "expired"
    kept = result(EDGE_ON, queue=1.0, total=2.0).model_copy(update={"offload": offload})
    got = record_of(job(), kept, left_at=T0, started=T0, sha256=None, predicted=None)
    assert (got.ran_on, got.code) == ("line-1-pc", "no_capacity")
    # A worker's own expiry: it never ran there either.
    late = result(POOL_ON, "expired", queue=5.0, total=5.0)
    assert (
        record_of(job(), late, left_at=T0, started=None, sha256=None, predicted=None).ran_on is None
    )


def test_the_record_keeps_the_wait_for_placements_and_why_the_answer_kept_it_here() -> None:
    # An expired job's code is its status's; why the broker kept it here is kept beside it.
    offload = wire.Offload(requested=True, placed=False, code="broker_timeout")
    expired = wire.JobResult(
        job_id="j1",
        status="expired",
        code="expired",
        ran_on=EDGE_ON,
        offload=offload,
        timings_ms=wire.Timings(queue_ms=250.0, total_ms=250.0),
    )
    got = record_of(
        job(), expired, left_at=T0 + 0.25, started=None, sha256=None, predicted=None, asked_s=0.05
    )
    assert (got.code, got.offload_code, got.placement_ms) == ("expired", "broker_timeout", 50.0)
    never = record_of(job(), result(EDGE_ON, queue=1.0, total=2.0), left_at=T0, started=T0,
                      sha256=None, predicted=None)  # fmt: skip
    assert (never.offload_code, never.placement_ms) == (None, None)


def test_a_refused_request_is_recorded_as_an_arrival_that_never_ran() -> None:
    got = refusal_of(job(), "rejected", "queue_full", now=T0 + 0.001)
    assert (got.status, got.code, got.ran_on, got.latency_ms) == ("rejected", "queue_full", None, 1)


def test_the_leg_from_the_app_is_recorded_when_the_app_stamped_its_send() -> None:
    stamped = replace(job(), sent_at=T0 - 0.0062)
    ran = result(EDGE_ON, queue=1.0, total=2.0)
    got = record_of(stamped, ran, left_at=T0 + 0.01, started=T0, sha256=None, predicted=None)
    assert got.inbound_ms == pytest.approx(6.2)
    assert refusal_of(stamped, "rejected", "queue_full", now=T0).inbound_ms == pytest.approx(6.2)
    # Unstamped: unknown, not zero; an app clock ahead of the edge's: no negative leg.
    assert (
        record_of(job(), ran, left_at=T0, started=T0, sha256=None, predicted=None).inbound_ms
        is None
    )
    ahead = replace(job(), sent_at=T0 + 0.5)
    assert (
        record_of(ahead, ran, left_at=T0, started=T0, sha256=None, predicted=None).inbound_ms == 0
    )


def test_the_batch_is_bounded_and_taken_whole() -> None:
    log = TraceLog("line-1-pc", offload=True, queue_bound=4, limit=2)
    record = refusal_of(job(), "rejected", "queue_full", now=T0)
    assert log.take() is None  # nothing gathered: nothing to send
    assert [log.add(record) for _ in range(3)] == [True, True, False]
    batch = log.take()
    assert batch is not None
    assert (batch.node, len(batch.records), batch.offload, batch.queue_bound) == (
        "line-1-pc",
        2,
        True,
        4,
    )
    assert log.take() is None
    back = wire.EdgeTrace.model_validate_json(wire.dump(batch))
    assert back == batch


# -- the agent ---------------------------------------------------------------------------------


def submit(job_id: str) -> Message:
    props = ((topics.PROP_MODEL, "defect-v1"), (topics.PROP_JOB_ID, job_id))
    return Message(
        topics.edge_submit("mem-edge"),
        JPEG,
        qos=1,
        response_topic="app/results",
        correlation_data=uuid.uuid4().bytes,
        content_type="image/jpeg",
        user_properties=(*props, (topics.PROP_DEADLINE_MS, "60000")),
    )


async def run_agent(trace_jobs: bool, jobs: int) -> tuple[MemoryBroker, EdgeAgent]:
    broker = MemoryBroker()
    edge = {"id": "mem-edge", "queue_size": 3, "concurrency": 1, "trace_jobs": trace_jobs}
    settings = load_settings(edge=edge).edge
    agent = EdgeAgent(settings, MemoryTransport(broker), REGISTRY)
    stop = asyncio.Event()
    runner = asyncio.ensure_future(agent.run(stop))
    await asyncio.wait_for(agent.ready.wait(), 10)
    for i in range(jobs):
        agent.on_message(submit(f"j{i}"))
    stop.set()
    await asyncio.wait_for(runner, 30)
    return broker, agent


async def test_the_agent_sends_each_concluded_job_once_and_the_refused_ones_too() -> None:
    # One runs, three wait, two are refused; the agent stops at once, so its last batch is
    # the one it sends before it goes offline.
    broker, agent = await run_agent(True, 6)
    batches = [m for m in broker.log if m.topic == topics.edge_trace("mem-edge")]
    records = [r for m in batches for r in wire.EdgeTrace.model_validate_json(m.payload).records]
    assert all(m.qos == 0 and not m.retain for m in batches)
    by_id = {r.job_id: r for r in records}
    assert len(records) == len(by_id) == 6
    ran = [by_id[f"j{i}"] for i in range(4)]
    assert all((r.status, r.ran_on, r.offloaded) == ("ok", "mem-edge", False) for r in ran)
    assert all(r.service_ms > 0 and r.latency_ms >= r.service_ms for r in ran)
    assert all(r.sha256 == REGISTRY.get("defect-v1").manifest.sha256 for r in ran)
    assert all(r.deadline_ms == 60_000 and r.bytes == len(JPEG) for r in ran)
    assert ran[3].queue_ms > ran[0].queue_ms  # the last one waited for three others
    assert (ran[3].predicted_ms or 0.0) > 0
    # Accepted (committed) after it arrived and before it started: its wait includes that.
    assert all(r.accepted_ms is not None and 0 < r.accepted_ms <= r.queue_ms for r in ran)
    refused = [by_id["j4"], by_id["j5"]]
    assert all((r.status, r.code, r.ran_on) == ("rejected", "queue_full", None) for r in refused)
    assert agent.counters["trace_dropped"] == 0
    assert agent.telemetry().finished == {"edge": 4}  # the refused ones ran nowhere


async def test_switched_off_the_agent_keeps_and_sends_no_records() -> None:
    broker, agent = await run_agent(False, 2)
    assert not [m for m in broker.log if m.topic == topics.edge_trace("mem-edge")]
    assert agent.results == {"ok": 2}


async def test_records_go_out_with_each_telemetry_and_only_when_there_are_some() -> None:
    broker = MemoryBroker()
    settings = load_settings(edge={"id": "mem-edge", "telemetry_interval_s": 0.05}).edge
    agent = EdgeAgent(settings, MemoryTransport(broker), REGISTRY)
    stop = asyncio.Event()
    runner = asyncio.ensure_future(agent.run(stop))
    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        telemetry = topics.edge_telemetry("mem-edge")
        await broker.wait_for(lambda m: m.topic == telemetry)  # an idle edge: telemetry only
        agent.on_message(submit("one"))
        sent = await broker.wait_for(lambda m: m.topic == topics.edge_trace("mem-edge"))
        assert [r.job_id for r in wire.EdgeTrace.model_validate_json(sent.payload).records] == [
            "one"
        ]
        before = {id(m) for m in broker.log}  # then one more telemetry, with nothing to add
        await broker.wait_for(lambda m: m.topic == telemetry and id(m) not in before)
    finally:
        stop.set()
        await asyncio.wait_for(runner, 30)
    sent_trace = [m for m in broker.log if m.topic == topics.edge_trace("mem-edge")]
    assert len(sent_trace) == 1  # no empty batches afterwards


def test_a_job_that_expired_while_offloaded_names_the_worker_it_was_placed_on() -> None:
    lost = wire.Offload(requested=True, placed=True, worker="north-cpu-1", code="lost")
    expired = wire.JobResult(
        job_id="j1",
        status="expired",
        code="expired",
        ran_on=EDGE_ON,
        timings_ms=wire.Timings(queue_ms=0.0, total_ms=0.0),
        offload=lost,
    )
    got = record_of(job(), expired, left_at=T0 + 0.2, started=None, sha256=None, predicted=None)
    assert (got.ran_on, got.offloaded, got.worker) == (None, False, "north-cpu-1")
    refused = expired.model_copy(
        update={"offload": wire.Offload(requested=True, placed=False, code="no_capacity")}
    )
    got = record_of(job(), refused, left_at=T0, started=None, sha256=None, predicted=None)
    assert got.worker is None


def test_the_record_keeps_when_the_edge_and_the_broker_predicted_completion() -> None:
    got = record_of(
        job(),
        result(POOL_ON, queue=5.0, total=20.0),
        left_at=T0 + 0.3,
        started=None,
        sha256=None,
        predicted=T0 + 0.9,
        accepted=T0 + 0.004,
        pool_predicted=T0 + 0.15,
    )
    assert (got.predicted_ms, got.accepted_ms, got.pool_predicted_ms) == (900.0, 4.0, 150.0)
