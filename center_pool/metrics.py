"""The pool worker's Prometheus metrics, named here and nowhere else: a collector that turns
the worker's figures into metric families each time ``/metrics`` is scraped.

The figures are the ones the worker keeps anyway (its queue, jobs in flight, refusals,
service-time averages, the jobs it returned: ``center_pool.job_figures``), read at the
scrape, so a metric can never drift from what the worker counted. Every metric carries the
``worker`` label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from center_pool.job_figures import WorkFigures
from sluicegate.node_metrics import add_histogram


@dataclass(frozen=True, slots=True)
class WorkerFigures:
    """What a scrape reads of one worker."""

    pool: str  # the policy's pool for this worker ("" before a policy is held)
    zone: str
    backend: str  # the runtime and device its first provider stands for
    device: str  # its declared device class
    queue_depth: int  # jobs queued or waiting to be screened
    in_flight: int  # jobs in batches running now
    running: int  # batch slots busy now
    concurrency: int  # batch slots
    memory_rss_bytes: int
    service_s: Mapping[str, float]  # moving average of a job's amortised compute, by model
    refused: Mapping[str, int]  # work refused unrun, by code
    jobs: WorkFigures
    usage_written: int = 0  # usage records committed by this process
    unmetered: int = 0  # attempts that ran and went out without a usage record
    usage_unacked: int = 0  # records shipped by this process, not acknowledged yet


class WorkerCollector:
    """The metrics of worker ``worker_id``, from ``read()`` at each scrape."""

    def __init__(self, worker_id: str, read: Callable[[], WorkerFigures]) -> None:
        self._worker = worker_id
        self._read = read

    def collect(self) -> Iterator[Metric]:
        f = self._read()
        worker = self._worker

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=["worker"])
            family.add_metric([worker], value)
            return family

        jobs = CounterMetricFamily(
            "sluicegate_worker_jobs",
            "Jobs this worker returned to their edge, by model and status (expired: its "
            "deadline passed before it could start, not run)",
            labels=["worker", "model", "status"],
        )
        for (model, status), n in sorted(f.jobs.jobs.items()):
            jobs.add_metric([worker, model, status], n)
        yield jobs
        refused = CounterMetricFamily(
            "sluicegate_worker_refused",
            "Work refused unrun (token, zone, hash, replay, queue full, ...), by code",
            labels=["worker", "code"],
        )
        for code in sorted(f.refused):
            refused.add_metric([worker, code], f.refused[code])
        yield refused
        seconds = HistogramMetricFamily(
            "sluicegate_worker_job_seconds",
            "Service time of each job run: its decode and preprocess, and its batch's inference",
            labels=["worker", "model"],
        )
        for model, buckets in sorted(f.jobs.seconds.items()):
            add_histogram(seconds, [worker, model], buckets.snapshot())
        yield seconds
        sizes = HistogramMetricFamily(
            "sluicegate_worker_batch_size", "Jobs per batch run", labels=["worker", "model"]
        )
        for model, buckets in sorted(f.jobs.batches.items()):
            add_histogram(sizes, [worker, model], buckets.snapshot())
        yield sizes
        yield gauge("sluicegate_worker_queue_depth", "Jobs waiting to run", f.queue_depth)
        yield gauge("sluicegate_worker_in_flight", "Jobs in batches running now", f.in_flight)
        yield gauge(
            "sluicegate_worker_utilisation",
            "Share of the worker's batch slots busy at the scrape (0..1); "
            "rate(sluicegate_worker_busy_seconds_total) / slots averages it",
            f.running / f.concurrency if f.concurrency else 0.0,
        )
        busy = CounterMetricFamily(
            "sluicegate_worker_busy_seconds",
            "Slot-seconds the worker's finished batches kept busy",
            labels=["worker"],
        )
        busy.add_metric([worker], f.jobs.busy_s)
        yield busy
        yield gauge(
            "sluicegate_worker_memory_rss_bytes",
            "The worker process's resident memory",
            f.memory_rss_bytes,
        )
        service = GaugeMetricFamily(
            "sluicegate_worker_model_service_seconds",
            "Moving average of a job's amortised compute (its batch's over its jobs), by model",
            labels=["worker", "model"],
        )
        for model in sorted(f.service_s):
            service.add_metric([worker, model], f.service_s[model])
        yield service
        usage = CounterMetricFamily(
            "sluicegate_worker_usage_records",
            "Usage records this worker wrote (one per attempt that ran), since it started",
            labels=["worker"],
        )
        usage.add_metric([worker], f.usage_written)
        yield usage
        unmetered = CounterMetricFamily(
            "sluicegate_worker_unmetered",
            "Attempts that ran and whose result went out without a usage record (the ledger "
            "failed, or a value no record can hold: see the log)",
            labels=["worker"],
        )
        unmetered.add_metric([worker], f.unmetered)
        yield unmetered
        yield gauge(
            "sluicegate_worker_usage_unacknowledged",
            "Usage records shipped since it started that no broker replica acknowledged yet",
            f.usage_unacked,
        )
        info = GaugeMetricFamily(
            "sluicegate_worker_info",
            "The worker's pool, zone, backend and device class (always 1)",
            labels=["worker", "pool", "zone", "backend", "device"],
        )
        info.add_metric([worker, f.pool, f.zone, f.backend, f.device], 1.0)
        yield info


def worker_registry(worker_id: str, read: Callable[[], WorkerFigures]) -> CollectorRegistry:
    """A registry of its own holding the worker's collector (one per worker process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker_id, read))
    return registry
