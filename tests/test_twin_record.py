"""The twin's recorder: the pure capture fed documents by hand (what it joins, what it leaves
out, what it refuses), then the recorder against a real local campus (a broker, two edges,
two workers as processes on real Mosquitto and Redis, secured as a plant runs it), in
process and through ``sluicegate twin record``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from sluicegate import topics, wire
from sluicegate.app.campus import LINES, OBSERVER, WORKERS
from sluicegate.app.localcampus import LocalCampus
from sluicegate.app.traffic import BURST_LINE, Sample, Tally, app_client, stream
from sluicegate.twin import trace as tr
from sluicegate.twin.capture import Capture, CaptureError
from sluicegate.twin.record import Recorded, record
from sluicegate.twin.sim import replay
from sluicegate.wire_pool import Completion, ModelCapability, WorkerCapabilities, WorkerTelemetry
from tests.policies.policy_testkit import NOW
from tests.pool_kit import POLICY, envelope
from tests.support import local_campus, twin

T0 = NOW  # the test policy is valid then
EDGE, ZONE, WORKER, WORKER_ZONE = "north-l1-pc", "campus/fab-north/line-1", "north-gpu-1", "dc"


def edge_telemetry(
    edge: str = EDGE, ts: float = T0 + 1.0, service_ms: float = 12.5, **events: int
) -> bytes:
    doc = wire.EdgeTelemetry(
        node=edge,
        zone=ZONE,
        ts=ts,
        queue_depth=2,
        queue_capacity=64,
        in_flight=1,
        concurrency=1,
        models={"defect-v1": wire.ModelLoad(service_ms=service_ms, completed=9)},
        cpu_percent=50.0,
        memory_rss_mb=100.0,
        memory_percent=1.0,
        results={"ok": 9},
        dropped_no_response_topic=0,
        events=events,
    )
    return wire.dump(doc)


def capabilities(worker: str = WORKER) -> bytes:
    model = ModelCapability(version="1", sha256="ab" * 32)
    doc = WorkerCapabilities(
        worker_id=worker,
        zone=WORKER_ZONE,
        device_class="nvidia-a100",
        providers=["CUDAExecutionProvider"],
        memory_total_mb=40_000,
        models={"defect-v1": model},
        max_batch=8,
        concurrency=2,
    )
    return wire.dump(doc)


def worker_telemetry(worker: str = WORKER, ts: float = T0 + 1.0, service_ms: float = 4.0) -> bytes:
    doc = WorkerTelemetry(
        node=worker,
        zone=WORKER_ZONE,
        ts=ts,
        device_class="nvidia-a100",
        utilisation=0.5,
        memory_used_mb=1000.0,
        memory_total_mb=40_000.0,
        queue_depth=3,
        in_flight=4,
        capacity=48,
        backlog_ms=20.0,
        models={"defect-v1": wire.ModelLoad(service_ms=service_ms, completed=90)},
        results={"ok": 90},
        refused={},
    )
    return wire.dump(doc)


def job(job_id: str, at: float, *, worker: str | None = None) -> wire.TraceJob:
    return wire.TraceJob(
        received_at=T0 + at,
        job_id=job_id,
        model="defect-v1",
        sha256="ab" * 32,
        data_class="wafer-image",
        priority=5,
        deadline_ms=200.0,
        bytes=50_000,
        status="ok",
        ran_on=worker or EDGE,
        offloaded=worker is not None,
        latency_ms=30.0,
        queue_ms=5.0,
        service_ms=12.0,
        predicted_ms=25.0 if worker is None else 400.0,
    )


def edge_trace(*records: wire.TraceJob, edge: str = EDGE) -> bytes:
    return wire.dump(wire.EdgeTrace(node=edge, records=list(records), queue_bound=4))


def completion(job_id: str, batch: int, worker: str = WORKER) -> bytes:
    doc = Completion(
        job_id=job_id,
        worker_id=worker,
        status="ok",
        model="defect-v1",
        service_ms=12.0,
        queue_ms=5.0,
        batch_size=batch,
        ts=T0 + 1.0,
        edge_id=EDGE,
    )
    return wire.dump(doc)


def fed(*messages: tuple[str, bytes], retained: bool = False) -> Capture:
    """A capture that started at T0 and heard the policy, then ``messages``."""
    capture = Capture(T0)
    assert capture.offer(topics.policy(), envelope(POLICY), now=T0, retained=True) is None
    for topic, payload in messages:
        assert capture.offer(topic, payload, now=T0 + 1.0, retained=retained) is None, topic
    return capture


def test_jobs_are_joined_with_their_batch_and_the_fleet_is_described() -> None:
    capture = fed(
        (topics.worker_capabilities(WORKER), capabilities()),
        (topics.worker_telemetry(WORKER), worker_telemetry()),
        (topics.completion(WORKER), completion("far", 5)),
        (topics.edge_telemetry(EDGE), edge_telemetry()),
        (topics.edge_trace(EDGE), edge_trace(job("here", 0.5), job("far", 0.25, worker=WORKER))),
    )
    trace = capture.trace()
    assert [(j.job_id, j.at, j.batch, j.offloaded) for j in trace.jobs] == [
        ("far", 0.25, 5, True),
        ("here", 0.5, 1, False),
    ]
    assert trace.jobs[1].predicted_ms == 25.0
    assert capture.unbatched == 0
    header = trace.header
    assert (header.started_at, header.source) == (T0, "live")
    assert tr.policy_of(header).digest == POLICY.digest
    assert header.params["stale_after_s"] == 3.0  # the broker's defaults
    (edge,) = header.edges
    assert (edge.id, edge.zone, edge.concurrency, edge.queue_size) == (EDGE, ZONE, 1, 64)
    assert (edge.queue_bound, edge.service_ms) == (4, {"defect-v1": 12.5})
    (worker,) = header.workers
    assert (worker.id, worker.zone, worker.capacity, worker.max_batch, worker.concurrency) == (
        WORKER,
        WORKER_ZONE,
        48,
        8,
        2,
    )
    assert worker.models == {"defect-v1": "ab" * 32}
    assert worker.service_ms == {"defect-v1": 4.0}
    assert [(t.node, t.kind, t.queue_depth) for t in trace.telemetry] == [
        (WORKER, "pool", 3),
        (EDGE, "edge", 2),
    ]


def test_the_fleet_s_service_times_are_those_it_believed_when_recording_began() -> None:
    # The edge and the worker learned slower times as the recording went on (a burst on a
    # busy machine); a replay starts from what they believed at its start and learns the
    # rest from the jobs' own runs, as they did. Everything else is the latest heard.
    capture = fed(
        (topics.worker_capabilities(WORKER), capabilities()),
        (topics.worker_telemetry(WORKER), worker_telemetry(service_ms=4.0)),
        (topics.worker_telemetry(WORKER), worker_telemetry(ts=T0 + 2.0, service_ms=9.0)),
        (topics.edge_telemetry(EDGE), edge_telemetry(service_ms=12.5)),
        (topics.edge_telemetry(EDGE), edge_telemetry(ts=T0 + 2.0, service_ms=30.0)),
        (topics.edge_trace(EDGE), edge_trace(job("here", 0.5))),
    )
    header = capture.trace().header
    assert [e.service_ms for e in header.edges] == [{"defect-v1": 12.5}]
    assert [w.service_ms for w in header.workers] == [{"defect-v1": 4.0}]
    assert [t.at for t in capture.trace().telemetry] == [1.0, 2.0, 1.0, 2.0]


def test_an_offloaded_job_whose_completion_was_not_heard_ran_alone_and_is_counted() -> None:
    capture = fed(
        (topics.edge_telemetry(EDGE), edge_telemetry()),
        (topics.completion(WORKER), completion("other", 3)),
        (topics.edge_trace(EDGE), edge_trace(job("far", 0.25, worker=WORKER))),
    )
    assert [(j.job_id, j.batch) for j in capture.trace().jobs] == [("far", 1)]
    assert capture.unbatched == 1


def test_a_trace_is_written_and_read_back_whole(tmp_path: Path) -> None:
    capture = fed(
        (topics.edge_telemetry(EDGE), edge_telemetry()),
        (topics.edge_trace(EDGE), edge_trace(job("a", 0.1), job("b", 0.2))),
    )
    path = tmp_path / "t.jsonl.gz"
    digest = tr.write(path, capture.trace())
    back, read_digest = tr.read(path)
    assert read_digest == digest
    assert back == capture.trace()


def test_jobs_from_before_the_start_or_after_the_end_and_repeats_are_left_out() -> None:
    capture = fed(
        (topics.edge_telemetry(EDGE), edge_telemetry()),
        (topics.edge_trace(EDGE), edge_trace(job("early", -0.5), job("in", 0.5))),
        (topics.edge_trace(EDGE), edge_trace(job("in", 0.5))),
    )
    capture.stop(T0 + 2.0)
    capture.offer(topics.edge_trace(EDGE), edge_trace(job("late", 2.5)), now=T0 + 3.0)
    assert [j.job_id for j in capture.trace().jobs] == ["in"]
    assert capture.left_out == {
        "before_start": 1,
        "repeated": 1,
        "after_end": 1,
        "unknown_edge": 0,
        "unreadable": 0,
    }


def test_jobs_from_an_edge_whose_telemetry_was_not_heard_are_left_out_and_counted() -> None:
    capture = fed(
        (topics.edge_telemetry(EDGE), edge_telemetry()),
        (topics.edge_trace(EDGE), edge_trace(job("a", 0.1))),
        (topics.edge_trace("north-l2-pc"), edge_trace(job("b", 0.1), edge="north-l2-pc")),
    )
    trace = capture.trace()
    assert [(j.edge, j.job_id) for j in trace.jobs] == [(EDGE, "a")]
    assert capture.left_out["unknown_edge"] == 1
    tr.check(trace.header, trace.jobs)  # the trace stays readable


@pytest.mark.parametrize(
    ("topic", "payload", "kind", "words"),
    [
        (topics.edge_trace(EDGE), b"{not json", "edge_trace", "not a EdgeTrace document"),
        (topics.edge_trace(EDGE), edge_trace(edge="north-l2-pc"), "edge_trace", "'north-l2-pc'"),
        (topics.edge_telemetry(EDGE), b'{"v": 2}', "edge_telemetry", "EdgeTelemetry"),
        (topics.completion("x"), completion("j", 1), "completion", f"{WORKER!r}"),
        (topics.worker_telemetry("x"), worker_telemetry(), "worker_telemetry", "only 'x'"),
        (topics.policy(), b'{"policy": {}, "signatures": []}', "policy", "signed policy"),
        ("sluicegate/v1/elsewhere", b"{}", "topic", "not a topic the recorder reads"),
    ],
)
def test_a_bad_document_is_refused_in_words_and_counted(
    topic: str, payload: bytes, kind: str, words: str
) -> None:
    capture = fed((topics.edge_telemetry(EDGE), edge_telemetry()))
    why = capture.offer(topic, payload, now=T0 + 1.0)
    assert why is not None
    assert why.startswith(f"{topic}: ")
    assert words in why
    assert capture.refused == {kind: 1}
    assert capture.notes == [why]
    capture.offer(topics.edge_trace(EDGE), edge_trace(job("after", 0.1)), now=T0 + 1.0)
    assert [j.job_id for j in capture.trace().jobs] == ["after"]  # the recording goes on


def test_status_changes_while_recording_are_node_events_and_retained_ones_are_not() -> None:
    def status(state: Literal["online", "offline"]) -> bytes:
        return wire.dump(wire.NodeStatus(node=WORKER, kind="pool", zone=WORKER_ZONE, state=state))

    capture = fed((topics.edge_telemetry(EDGE), edge_telemetry()))
    topic = topics.worker_status(WORKER)
    capture.offer(topic, status("online"), now=T0 + 0.1, retained=True)
    capture.offer(topic, status("offline"), now=T0 + 1.5)
    capture.offer(topic, status("offline"), now=T0 + 1.6)
    capture.offer(topic, status("online"), now=T0 + 2.5)
    events = capture.trace().events
    assert [(e.at, e.node, e.what) for e in events] == [
        (1.5, WORKER, "offline"),
        (2.5, WORKER, "online"),
    ]


def test_an_edge_s_book_of_announced_work_is_recorded_retained_or_changed() -> None:
    window = wire.Announced(
        announcement_id="shift-b",
        starts_at=T0 + 30.0,
        ends_at=T0 + 90.0,
        rate_per_s=40.0,
        model="surface-det",
        data_class="part-image",
        local_per_s=6.0,
    )
    book = wire.EdgeSchedule(node=EDGE, zone=ZONE, ts=T0, windows=[window])
    capture = fed((topics.edge_telemetry(EDGE), edge_telemetry()))
    topic = topics.edge_announced(EDGE)
    assert capture.offer(topic, wire.dump(book), now=T0 + 0.1, retained=True) is None
    assert capture.offer(topic, b"", now=T0 + 2.0) is None  # the book cleared
    forged = book.model_copy(update={"node": "line-9"})
    assert "only 'north-l1-pc'" in (capture.offer(topic, wire.dump(forged), now=T0 + 2.5) or "")
    announced = capture.trace().announced
    assert [(a.at, a.edge, [w.announcement_id for w in a.windows]) for a in announced] == [
        (0.1, EDGE, ["shift-b"]),
        (2.0, EDGE, []),
    ]


def test_without_a_policy_or_an_edge_there_is_no_trace_and_it_says_why() -> None:
    capture = Capture(T0)
    capture.offer(topics.edge_telemetry(EDGE), edge_telemetry(), now=T0 + 1.0)
    with pytest.raises(CaptureError, match="no signed policy arrived on sluicegate/v1/policy"):
        capture.trace()
    given = Capture(T0, policy_text=POLICY.canonical.decode())
    with pytest.raises(CaptureError, match="no edge telemetry was heard"):
        given.trace()


def test_the_interval_is_measured_and_the_end_waits_for_every_edge() -> None:
    capture = fed(
        (topics.edge_telemetry(EDGE), edge_telemetry(ts=T0 + 1.0)),
        (topics.edge_telemetry(EDGE), edge_telemetry(ts=T0 + 1.5)),
        (topics.edge_telemetry("north-l2-pc"), edge_telemetry("north-l2-pc", ts=T0 + 1.2)),
        (topics.edge_telemetry(EDGE), edge_telemetry(ts=T0 + 2.0, trace_dropped=3)),
    )
    assert capture.interval_s() == 0.5
    assert Capture(T0, telemetry_interval_s=2.0).interval_s() == 2.0
    assert capture.edge_dropped() == 3
    assert not capture.caught_up()
    capture.stop(T0 + 2.0)
    capture.offer(topics.edge_telemetry(EDGE), edge_telemetry(ts=T0 + 2.5), now=T0 + 2.5)
    assert not capture.caught_up()  # line 2 has not spoken since the end
    capture.offer(topics.edge_telemetry("north-l2-pc"), edge_telemetry("north-l2-pc"), now=T0 + 3)
    assert capture.caught_up()


# -- a real campus -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def campus(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[LocalCampus]:
    with local_campus(tmp_path_factory.mktemp("twin-record-campus"), fresh_redis_db()) as lc:
        yield lc


@dataclass
class Seen(Tally):
    """What the apps saw, and every result by job id."""

    results: dict[str, wire.JobResult] = field(default_factory=dict)
    app_ms: dict[str, float] = field(default_factory=dict)

    def record(self, line: str, sample: Sample, result: wire.JobResult, ms: float) -> None:
        self.results[result.job_id] = result
        self.app_ms[result.job_id] = ms
        super().record(line, sample, result, ms)


def check_against_the_apps(trace: tr.Trace, seen: Seen) -> None:
    assert seen.errors == {}
    assert seen.answered == sum(seen.submitted.values()) == len(seen.results) > 0
    by_id = {j.job_id: j for j in trace.jobs}
    assert len(by_id) == len(trace.jobs)  # each job once
    assert set(by_id) == set(seen.results)
    for job_id, result in seen.results.items():
        job = by_id[job_id]
        assert job.status == result.status, job_id
        if job.ran_on is None:  # it never ran (expired waiting, say): the result says where
            assert result.status != "ok", job_id
        else:
            assert job.ran_on == result.ran_on.node, job_id
            assert job.offloaded == (result.ran_on.kind == "pool"), job_id
        # The client stamped its send: the leg to the edge is in the trace, inside what the
        # app waited in all.
        assert job.inbound_ms is not None, job_id
        assert job.inbound_ms + job.latency_ms <= seen.app_ms[job_id], job_id
    assert all(j.batch >= 1 and j.service_ms > 0 for j in trace.jobs if j.offloaded)
    assert all(j.service_ms > 0 for j in trace.jobs if j.status == "ok")
    header = trace.header
    assert {(e.id, e.zone) for e in header.edges} == set(LINES.items())
    assert {(w.id, w.zone) for w in header.workers} == {(w, z) for w, (z, _c) in WORKERS.items()}
    assert all(e.queue_bound == 4 and e.concurrency == 1 for e in header.edges)
    assert all(w.models and w.capacity >= 1 for w in header.workers)
    assert header.telemetry_interval_s == pytest.approx(1.0, abs=0.2)
    assert tr.policy_of(header).campus == "demo-campus"
    assert {t.node for t in trace.telemetry} == set(LINES) | set(WORKERS)


@pytest.mark.integration
@pytest.mark.slow
def test_the_recorder_hears_every_job_the_apps_got_a_result_for(
    campus: LocalCampus, tmp_path: Path
) -> None:
    out, seen = tmp_path / "trace.jsonl.gz", Seen()

    async def run() -> Recorded:
        ready, stop = asyncio.Event(), asyncio.Event()
        mqtt = campus.write().mqtt(OBSERVER)
        recorder = asyncio.ensure_future(record(mqtt, out, stop, ready=ready))
        await asyncio.wait_for(ready.wait(), 10)
        # Line 1's app announces a shift to come: the trace holds the edge's book.
        app = app_client(campus.write(), BURST_LINE)
        await app.connect()
        starts = time.time() + 30.0
        told = await app.announce(
            "shift-b",
            starts_at=starts,
            ends_at=starts + 60.0,
            rate_per_s=500.0,
            model="surface-det",
            data_class="part-image",
            timeout=10.0,
        )
        await app.close()
        assert told.status == "accepted", told
        # Steady traffic, and a second's burst on line 1 that its PC passes on to the pool.
        await stream(campus.write(), 5.0, 4.0, asyncio.Event(), seen, burst_at=2.0, burst_for=1.0)
        stop.set()
        return await asyncio.wait_for(recorder, 15)

    recorded = asyncio.run(run())
    trace, digest = tr.read(out)
    assert digest == recorded.digest
    assert (recorded.refused, recorded.unbatched, recorded.edge_dropped) == ({}, 0, 0)
    check_against_the_apps(trace, seen)
    assert any(j.offloaded for j in trace.jobs), "the burst must offload some jobs"
    books = [a for a in trace.announced if a.edge == BURST_LINE]
    assert [w.announcement_id for w in books[-1].windows] == ["shift-b"]
    # the replay hears it as the broker did: announced jobs/s in the scaling signal
    signal = replay(trace).signal
    assert sum(max(r.announced_jobs_s for r in rs) for rs in signal.values()) > 0


@pytest.mark.integration
@pytest.mark.slow
def test_the_record_command_writes_a_trace_of_the_campus(
    campus: LocalCampus, tmp_path: Path
) -> None:
    out, seen = tmp_path / "cli.jsonl.gz", Seen()
    observer = campus.write().node_config(OBSERVER)
    assert "tls_cert_file" in observer.read_text()
    command = [sys.executable, "-m", "sluicegate.app.cli", "twin", "record"]
    command += ["--config", str(observer), "--out", str(out), "--seconds", "5"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    said = b""
    while not said.startswith(b"recording"):  # once subscribed; EOF: it failed
        said = proc.stderr.readline()
        assert said, proc.communicate(timeout=10)
    asyncio.run(stream(campus.write(), 5.0, 2.0, asyncio.Event(), seen, burst_at=99.0))
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr.decode()
    assert f"wrote {out}" in stdout.decode()
    trace, _digest = tr.read(out)
    check_against_the_apps(trace, seen)


def test_a_job_that_came_back_too_late_keeps_its_workers_times() -> None:
    late = job("late", 0.25).model_copy(
        update={
            "status": "expired",
            "ran_on": None,
            "offloaded": False,
            "worker": WORKER,
            "latency_ms": 200.0,
            "queue_ms": 0.0,
            "service_ms": 0.0,
        }
    )
    capture = fed(
        (topics.worker_capabilities(WORKER), capabilities()),
        (topics.worker_telemetry(WORKER), worker_telemetry()),
        (topics.completion(WORKER), completion("late", 3)),
        (topics.edge_telemetry(EDGE), edge_telemetry()),
        (topics.edge_trace(EDGE), edge_trace(late)),
    )
    (rec,) = capture.trace().jobs
    assert (rec.status, rec.worker, rec.offloaded, rec.batch) == ("expired", WORKER, False, 3)
    assert (rec.queue_ms, rec.service_ms) == (5.0, 12.0)  # the worker's, from its completion
    assert rec.worker_done_ms == 750.0  # completed at T0 + 1.0, arrived at T0 + 0.25


@pytest.mark.integration
@pytest.mark.slow
def test_a_trace_derived_from_the_audit_log_holds_every_offered_job(
    campus: LocalCampus, tmp_path: Path
) -> None:
    seen = Seen()
    asyncio.run(
        stream(campus.write(), 5.0, 3.0, asyncio.Event(), seen, burst_at=1.0, burst_for=1.0)
    )
    offloaded = {i: r for i, r in seen.results.items() if r.ran_on.kind == "pool"}
    assert offloaded, "the burst must offload some jobs"
    out = tmp_path / "audit.jsonl.gz"
    broker = campus.write().node_config("broker-1")
    done = twin("from-audit", "--config", str(broker), "--out", str(out), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "verified audit records" in done.stdout
    trace, _ = tr.read(out)
    assert trace.header.source == "audit"
    assert {(e.id, e.zone) for e in trace.header.edges} == set(LINES.items())
    assert {w.id for w in trace.header.workers} == set(WORKERS)
    by_id = {j.job_id: j for j in trace.jobs}
    assert len(by_id) == len(trace.jobs)
    for job_id, result in offloaded.items():  # every job that ran on a pool was offered
        job = by_id[job_id]
        assert job.offloaded, job_id
        assert job.worker == result.ran_on.node, job_id
        assert job.bytes > 0
        assert job.deadline_ms is not None
    # ... and the derived trace replays through the twin.
    assert len(replay(trace).outcomes) == len(trace.jobs)
