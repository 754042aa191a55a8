"""The edge agent's Prometheus metrics, named here and nowhere else: a collector that turns
the agent's figures into metric families each time ``/metrics`` is scraped.

The figures are the ones its telemetry publishes (answers by status, ok jobs by where they
ran, event counters, queue, service times, CPU, memory, policy version) and the concluded
jobs' figures (``edge_agent.job_figures``). Nothing here counts: it only reads, so a metric
can never drift from what the agent counted. Every metric carries the ``edge`` label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from edge_agent.job_figures import JobFigures
from edge_agent.reporting import Load
from edge_agent.tally import Tally
from sluicegate.node_metrics import add_histogram

RAN_ON = ("edge", "pool")
OUTCOMES = ("met", "missed")


class EdgeFigures(NamedTuple):
    """What a scrape reads: the telemetry's figures and the concluded jobs'."""

    load: Load
    jobs: JobFigures


class EdgeCollector:
    """The metrics of edge ``edge_id``, from ``read()`` at each scrape."""

    def __init__(self, edge_id: str, read: Callable[[], EdgeFigures]) -> None:
        self._edge = edge_id
        self._read = read

    def collect(self) -> Iterator[Metric]:
        figures = self._read()
        load, jobs = figures.load, figures.jobs
        edge = self._edge

        def counter(name: str, doc: str, label: str, values: dict[str, int]) -> Metric:
            family = CounterMetricFamily(name, doc, labels=["edge", label])
            for key in sorted(values):
                family.add_metric([edge, key], values[key])
            return family

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=["edge"])
            family.add_metric([edge], value)
            return family

        yield counter(
            "sluicegate_edge_results",
            "Answers this edge gave apps, by status (refusals and concluded jobs)",
            "status",
            dict(load.results),
        )
        yield counter(
            "sluicegate_edge_jobs_run",
            "Jobs answered ok, by where they ran (edge, pool)",
            "ran_on",
            dict.fromkeys(RAN_ON, 0) | dict(load.finished),
        )
        yield counter(
            "sluicegate_edge_deadline",
            "Concluded jobs that had a deadline, by whether their result left the edge by it",
            "outcome",
            dict.fromkeys(OUTCOMES, 0) | dict(jobs.deadline),
        )
        seconds = HistogramMetricFamily(
            "sluicegate_edge_job_seconds",
            "Ok jobs' times by where they ran and part: total (arrival to the result leaving "
            "the edge), queue, inference, transfer (pool jobs: total - queue - inference)",
            labels=["edge", "ran_on", "part"],
        )
        for (ran_on, part), buckets in sorted(jobs.seconds.items()):
            add_histogram(seconds, [edge, ran_on, part], buckets.snapshot())
        yield seconds
        yield counter(
            "sluicegate_edge_stayed_local",
            "Ok jobs that ran here, by why they were not offloaded (the result's offload "
            "code; not_offered: the edge never asked)",
            "code",
            dict(jobs.stayed_local),
        )
        yield counter(
            "sluicegate_edge_events",
            "Things that happened to jobs and messages, by event",
            "event",
            dict.fromkeys((t.value for t in Tally), 0) | dict(load.events),
        )
        offloaded = CounterMetricFamily(
            "sluicegate_edge_offloaded", "Work messages sent to pool workers", labels=["edge"]
        )
        offloaded.add_metric([edge], load.offloaded)
        yield offloaded
        yield gauge(
            "sluicegate_edge_queue_depth", "Jobs waiting for a local slot", load.queue_depth
        )
        yield gauge("sluicegate_edge_in_flight", "Local compute slots held", load.in_flight)
        yield gauge(
            "sluicegate_edge_offload_pending",
            "Jobs waiting for the broker's placement answer",
            load.offload_pending,
        )
        service = GaugeMetricFamily(
            "sluicegate_edge_model_service_seconds",
            "Moving average of a job's service time here, by model",
            labels=["edge", "model"],
        )
        completed = CounterMetricFamily(
            "sluicegate_edge_model_completed",
            "Jobs of each model run here",
            labels=["edge", "model"],
        )
        for name in sorted(load.models):
            model = load.models[name]
            service.add_metric([edge, name], model.service_s)
            completed.add_metric([edge, name], model.completed)
        yield service
        yield completed
        yield gauge(
            "sluicegate_edge_cpu_percent",
            "The agent process's CPU use at its last telemetry (100 = one core)",
            load.cpu_percent,
        )
        yield gauge(
            "sluicegate_edge_memory_rss_bytes",
            "The agent process's resident memory",
            load.memory_rss_bytes,
        )
        version = GaugeMetricFamily(
            "sluicegate_edge_policy_version",
            "Version of the verified policy the edge holds (absent: none yet)",
            labels=["edge"],
        )
        if load.policy_version is not None:
            version.add_metric([edge], load.policy_version)
        yield version


def edge_registry(edge_id: str, read: Callable[[], EdgeFigures]) -> CollectorRegistry:
    """A registry of its own holding the edge's collector (one per agent process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EdgeCollector(edge_id, read))
    return registry
