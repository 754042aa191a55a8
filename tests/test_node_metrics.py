"""The nodes' Prometheus metrics from plain figures: histogram buckets, what an edge counts
of each concluded job, the edge's and the worker's collectors rendered as Prometheus text,
and the ``/metrics`` server (a free port, a taken port, the default address)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from center_pool.job_figures import WorkFigures
from center_pool.metrics import WorkerFigures, worker_registry
from edge_agent.admission import Job
from edge_agent.job_figures import NOT_OFFERED, JobFigures, stayed_code
from edge_agent.load import ModelFigures
from edge_agent.metrics import EdgeFigures, edge_registry
from edge_agent.reporting import Load
from sluicegate import wire
from sluicegate.buckets import Buckets
from sluicegate.config import EdgeSettings, PoolSettings
from sluicegate.node_metrics import MetricsServer
from sluicegate.vision.image import ImageInfo
from tests.metrics_kit import Samples, samples

T0 = 1_700_000_000.0
EDGE_ON = wire.RanOn(kind="edge", node="line-1-pc", zone="campus/line-1")
POOL_ON = wire.RanOn(kind="pool", node="north-cpu-1", zone="campus/dc")


def value(found: Samples, name: str, **labels: str) -> float:
    return found[(name, frozenset(labels.items()))]


def job(deadline_s: float | None = 0.2) -> Job:
    return Job(
        "j1",
        "defect-v1",
        b"x",
        ImageInfo("jpeg", 8, 8),
        "app/results",
        None,
        5,
        "wafer-image",
        T0,
        T0 + deadline_s if deadline_s is not None else None,
    )


def result(
    status: wire.Status = "ok",
    on: wire.RanOn = EDGE_ON,
    offload: wire.Offload | None = None,
    queue_ms: float = 10.0,
    inference_ms: float = 20.0,
) -> wire.JobResult:
    times = wire.Timings(queue_ms=queue_ms, inference_ms=inference_ms, total_ms=40.0)
    return wire.JobResult(job_id="j1", status=status, ran_on=on, timings_ms=times, offload=offload)


# -- buckets -----------------------------------------------------------------------------------


def test_buckets_are_cumulative_and_le_inclusive() -> None:
    b = Buckets((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        b.observe(v)
    snap = b.snapshot()
    assert snap.buckets == ((0.1, 2), (1.0, 3))
    assert (snap.count, snap.total) == (4, pytest.approx(3.65))


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0)])
def test_buckets_refuse_bounds_out_of_order(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        Buckets(bounds)


# -- what the edge counts of a concluded job ---------------------------------------------------


@pytest.mark.parametrize(
    ("left_after_s", "outcome"), [(0.1, "met"), (0.2, "met"), (0.2001, "missed"), (5.0, "missed")]
)
def test_deadline_by_when_the_result_left(left_after_s: float, outcome: str) -> None:
    figures = JobFigures()
    figures.concluded(job(0.2), result(), left_at=T0 + left_after_s)
    assert figures.deadline == {outcome: 1}


def test_a_job_without_deadline_and_a_failed_one() -> None:
    figures = JobFigures()
    figures.concluded(job(None), result(), left_at=T0 + 1.0)
    figures.concluded(job(0.5), result("expired"), left_at=T0 + 1.0)
    assert figures.deadline == {"missed": 1}  # the expired one; the other had no deadline
    assert figures.seconds[("edge", "total")].count == 1  # only the ok job has times
    assert sum(figures.stayed_local.values()) == 1


def test_part_times_of_a_pool_job_include_transfer() -> None:
    figures = JobFigures()
    pool = wire.Offload(requested=True, placed=True, worker="north-cpu-1")
    figures.concluded(job(), result(on=POOL_ON, offload=pool), left_at=T0 + 0.1)
    by_part = {part: b.snapshot().total for (on, part), b in figures.seconds.items()}
    assert set(by_part) == {"total", "queue", "inference", "transfer"}
    assert by_part["total"] == pytest.approx(0.1, abs=1e-6)
    assert by_part["transfer"] == pytest.approx(0.1 - 0.01 - 0.02, abs=1e-6)
    assert not figures.stayed_local


@pytest.mark.parametrize(
    ("offload", "code"),
    [
        (None, NOT_OFFERED),
        (wire.Offload(requested=True, placed=False, code="no_capacity"), "no_capacity"),
        (wire.Offload(requested=True, placed=True, worker="w", code="worker_lost"), "worker_lost"),
    ],
)
def test_why_a_local_job_stayed(offload: wire.Offload | None, code: str) -> None:
    assert stayed_code(result(offload=offload)) == code


# -- the edge's collector ----------------------------------------------------------------------


def edge_load(**changes: object) -> Load:
    base = Load(
        now=T0,
        queue_depth=3,
        in_flight=1,
        models={"defect-v1": ModelFigures(0.012, 7)},
        cpu_percent=55.5,
        memory_rss_bytes=123_456_789,
        memory_percent=1.0,
        results={"ok": 9, "rejected": 2},
        finished={"edge": 7, "pool": 2},
        dropped_no_response_topic=0,
        offloaded=3,
        offload_pending=1,
        events={"accepted": 9},
        policy_version=4,
    )
    return dataclasses.replace(base, **changes)


def scrape_edge(load: Load, jobs: JobFigures) -> Samples:
    registry = edge_registry("line-1-pc", lambda: EdgeFigures(load, jobs))
    return samples(generate_latest(registry).decode())


def test_edge_collector_reads_the_telemetry_figures() -> None:
    jobs = JobFigures()
    jobs.concluded(job(0.2), result(), left_at=T0 + 0.05)
    jobs.concluded(job(0.2), result(), left_at=T0 + 0.5)
    got = scrape_edge(edge_load(), jobs)
    e = {"edge": "line-1-pc"}
    assert value(got, "sluicegate_edge_results_total", **e, status="ok") == 9
    assert value(got, "sluicegate_edge_results_total", **e, status="rejected") == 2
    assert value(got, "sluicegate_edge_jobs_run_total", **e, ran_on="edge") == 7
    assert value(got, "sluicegate_edge_jobs_run_total", **e, ran_on="pool") == 2
    assert value(got, "sluicegate_edge_deadline_total", **e, outcome="met") == 1
    assert value(got, "sluicegate_edge_deadline_total", **e, outcome="missed") == 1
    part = {**e, "ran_on": "edge", "part": "total"}
    assert value(got, "sluicegate_edge_job_seconds_count", **part) == 2
    assert value(got, "sluicegate_edge_job_seconds_bucket", **part, le="0.05") == 1
    assert value(got, "sluicegate_edge_job_seconds_bucket", **part, le="+Inf") == 2
    assert value(got, "sluicegate_edge_stayed_local_total", **e, code=NOT_OFFERED) == 2
    assert value(got, "sluicegate_edge_events_total", **e, event="accepted") == 9
    assert value(got, "sluicegate_edge_events_total", **e, event="dead_letters") == 0
    assert value(got, "sluicegate_edge_offloaded_total", **e) == 3
    assert value(got, "sluicegate_edge_queue_depth", **e) == 3
    assert value(got, "sluicegate_edge_in_flight", **e) == 1
    assert value(got, "sluicegate_edge_offload_pending", **e) == 1
    model = {**e, "model": "defect-v1"}
    assert value(got, "sluicegate_edge_model_service_seconds", **model) == pytest.approx(0.012)
    assert value(got, "sluicegate_edge_model_completed_total", **model) == 7
    assert value(got, "sluicegate_edge_cpu_percent", **e) == 55.5
    assert value(got, "sluicegate_edge_memory_rss_bytes", **e) == 123_456_789
    assert value(got, "sluicegate_edge_policy_version", **e) == 4


def test_edge_collector_before_any_job_or_policy() -> None:
    load = edge_load(results={}, finished={}, events={}, models={}, policy_version=None)
    got = scrape_edge(load, JobFigures())
    e = {"edge": "line-1-pc"}
    for ran_on in ("edge", "pool"):  # a series from the start: rate() and sums work at once
        assert value(got, "sluicegate_edge_jobs_run_total", **e, ran_on=ran_on) == 0
    for outcome in ("met", "missed"):
        assert value(got, "sluicegate_edge_deadline_total", **e, outcome=outcome) == 0
    assert not [k for k in got if k[0] == "sluicegate_edge_policy_version"]


# -- the worker's collector --------------------------------------------------------------------


def test_worker_collector_reads_its_figures() -> None:
    jobs = WorkFigures()
    jobs.batch("defect-v1", 3, busy_s=0.03)
    for _ in range(3):
        jobs.returned("defect-v1", "ok", 0.02)
    jobs.returned("defect-v1", "expired")
    figures = WorkerFigures(
        pool="campus-dc",
        zone="campus/dc",
        backend="onnxruntime/CPUExecutionProvider",
        device="x86-cpu",
        queue_depth=4,
        in_flight=2,
        running=1,
        concurrency=2,
        memory_rss_bytes=99,
        service_s={"defect-v1": 0.007},
        refused={"token.expired": 2},
        jobs=jobs,
    )
    got = samples(generate_latest(worker_registry("north-cpu-1", lambda: figures)).decode())
    w = {"worker": "north-cpu-1"}
    m = {**w, "model": "defect-v1"}
    assert value(got, "sluicegate_worker_jobs_total", **m, status="ok") == 3
    assert value(got, "sluicegate_worker_jobs_total", **m, status="expired") == 1
    assert value(got, "sluicegate_worker_refused_total", **w, code="token.expired") == 2
    assert value(got, "sluicegate_worker_job_seconds_count", **m) == 3  # the expired one: not run
    assert value(got, "sluicegate_worker_job_seconds_sum", **m) == pytest.approx(0.06)
    assert value(got, "sluicegate_worker_batch_size_bucket", **m, le="2.0") == 0
    assert value(got, "sluicegate_worker_batch_size_bucket", **m, le="4.0") == 1
    assert value(got, "sluicegate_worker_queue_depth", **w) == 4
    assert value(got, "sluicegate_worker_in_flight", **w) == 2
    assert value(got, "sluicegate_worker_utilisation", **w) == 0.5
    assert value(got, "sluicegate_worker_busy_seconds_total", **w) == pytest.approx(0.03)
    assert value(got, "sluicegate_worker_memory_rss_bytes", **w) == 99
    assert value(got, "sluicegate_worker_model_service_seconds", **m) == pytest.approx(0.007)
    info = {
        **w,
        "pool": "campus-dc",
        "zone": "campus/dc",
        "backend": "onnxruntime/CPUExecutionProvider",
        "device": "x86-cpu",
    }
    assert value(got, "sluicegate_worker_info", **info) == 1


# -- the server --------------------------------------------------------------------------------


def test_metrics_are_on_localhost_by_default() -> None:
    assert (EdgeSettings().metrics_host, EdgeSettings().metrics_port) == ("127.0.0.1", 9464)
    assert (PoolSettings().metrics_host, PoolSettings().metrics_port) == ("127.0.0.1", 9465)
    assert EdgeSettings().metrics_enabled
    assert PoolSettings().metrics_enabled


def fetch(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.headers["Content-Type"], reply.read().decode()


def registry_of(edge: str) -> CollectorRegistry:
    return edge_registry(edge, lambda: EdgeFigures(edge_load(), JobFigures()))


async def test_server_on_a_free_port_serves_the_registry() -> None:
    server = MetricsServer(registry_of("e1"), host="127.0.0.1", port=0, setting="[edge] x")
    assert await server.start() is not None
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        kind, text = await asyncio.to_thread(fetch, server.url)
        assert kind.startswith("text/plain")
        assert value(samples(text), "sluicegate_edge_queue_depth", edge="e1") == 3
    finally:
        await server.stop()
    assert server.url is None


async def test_a_taken_port_is_logged_and_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        setting = "[edge] metrics_host/metrics_port"
        server = MetricsServer(registry_of("e1"), host="127.0.0.1", port=port, setting=setting)
        with caplog.at_level(logging.ERROR, logger="sluicegate.node_metrics"):
            assert await server.start() is None
    assert server.url is None
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert f"127.0.0.1:{port}" in record.getMessage()
    assert setting in record.getMessage()
    await server.stop()  # nothing to stop: harmless
