"""What a pool worker tells the campus, built from plain figures: capabilities (retained),
telemetry (every interval: its load, the work it holds in ms, its service times), status
(retained, with the offline copy as Last Will), results for vision apps and completion
records for the broker.

Pure builders over the worker's counters and a hardware sample; they never publish, never
read a clock and never look at an image. Per-model service time is an exponentially
weighted moving average of the *amortised* compute per job (a batch's decode, preprocess and
inference divided by its jobs): the cost a placement adds to this worker. The per-batch
figure is kept apart, for the deadline-aware flush.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from center_pool.hardware import Sample
from sluicegate import topics, wire
from sluicegate.config import PoolSettings
from sluicegate.transport import Will
from sluicegate.vision.openvino_session import backend_of
from sluicegate.vision.runtime import ModelRegistry
from sluicegate.wire_pool import ModelCapability, WorkerCapabilities, WorkerTelemetry


@dataclass(slots=True)
class _Figure:
    job_ms: float
    batch_ms: float
    completed: int


class ServiceStats:
    """Moving averages of compute time per model: per job (amortised) and per batch."""

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self._alpha = alpha
        self._figures: dict[str, _Figure] = {}

    def observe(self, model: str, batch_ms: float, jobs: int) -> None:
        if jobs < 1:
            return
        job_ms = batch_ms / jobs
        old = self._figures.get(model)
        if old is None:
            self._figures[model] = _Figure(job_ms, batch_ms, jobs)
            return
        a = self._alpha
        old.job_ms += a * (job_ms - old.job_ms)
        old.batch_ms += a * (batch_ms - old.batch_ms)
        old.completed += jobs

    def seed(self, model: str, job_ms: float, batch_ms: float) -> None:
        """Start ``model``'s averages at measured priors (no completed job yet); a model
        already measured here keeps its figures."""
        self._figures.setdefault(model, _Figure(job_ms, batch_ms, 0))

    def batch_estimate_s(self, model: str) -> float | None:
        """Expected seconds for one batch of ``model``; None until one has run."""
        figure = self._figures.get(model)
        return figure.batch_ms / 1000.0 if figure else None

    def backlog_ms(self, jobs: Mapping[str, int], unknown: int = 0) -> float:
        """The work ``jobs`` (waiting or running, by model) hold, ms: each at its own model's
        amortised job time; a model not measured yet, and the ``unknown`` jobs whose model
        is not read yet, at the mean of those measured (none measured: nothing known, 0)."""
        known = [f.job_ms for f in self._figures.values()]
        mean = sum(known) / len(known) if known else 0.0
        held = sum(
            n * (self._figures[m].job_ms if m in self._figures else mean) for m, n in jobs.items()
        )
        return held + unknown * mean

    def loads(self) -> dict[str, wire.ModelLoad]:
        return {
            name: wire.ModelLoad(service_ms=round(f.job_ms, 3), completed=f.completed)
            for name, f in self._figures.items()
        }


def status_message(settings: PoolSettings, state: str) -> bytes:
    """The retained status document (``online``/``offline``) of this worker."""
    return wire.dump(
        wire.node_status(
            settings.id, "pool", settings.zone, "online" if state == "online" else "offline"
        )
    )


def last_will(settings: PoolSettings) -> Will:
    return Will(topics.worker_status(settings.id), status_message(settings, "offline"))


def capabilities(
    settings: PoolSettings,
    registry: ModelRegistry,
    providers: list[str],
    memory_total_mb: int,
    seal_key: str | None = None,
) -> WorkerCapabilities:
    """What this worker can run, and its current sealing key. A model that needs providers
    this worker lacks is left out, so the broker never places it here."""
    models: dict[str, ModelCapability] = {}
    for name in registry.names():
        manifest = registry.get(name).manifest
        needs = manifest.requirements.providers
        usable = [p for p in providers if not needs or p in needs]
        if not usable:
            continue
        models[name] = ModelCapability(
            version=manifest.version,
            sha256=manifest.sha256,
            memory_mb=manifest.requirements.memory_mb,
            providers=usable,
            backend=backend_of(registry.get(name).session.get_providers()[0]),
        )
    return WorkerCapabilities(
        worker_id=settings.id,
        zone=settings.zone,
        device_class=settings.device_class,
        providers=list(providers),
        memory_total_mb=memory_total_mb,
        models=models,
        max_batch=settings.max_batch,
        concurrency=settings.concurrency,
        seal_key=seal_key,
    )


def capacity(settings: PoolSettings) -> int:
    """Jobs the worker holds (queued plus running) before it refuses with ``queue_full``."""
    return settings.queue_size + settings.concurrency * settings.max_batch


def telemetry(
    settings: PoolSettings,
    sample: Sample,
    *,
    ts: float,
    queue_depth: int,
    in_flight: int,
    service: ServiceStats,
    results: Mapping[str, int],
    refused: Mapping[str, int],
    backlog_ms: float | None = None,
) -> WorkerTelemetry:
    return WorkerTelemetry(
        node=settings.id,
        zone=settings.zone,
        ts=ts,
        device_class=settings.device_class,
        utilisation=round(sample.utilisation, 4),
        memory_used_mb=round(max(0.0, sample.memory_used_mb), 1),
        memory_total_mb=round(max(0.0, sample.memory_total_mb), 1),
        memory_bandwidth=(
            round(sample.memory_bandwidth, 4) if sample.memory_bandwidth is not None else None
        ),
        temperature_c=sample.temperature_c,
        queue_depth=queue_depth,
        in_flight=in_flight,
        capacity=capacity(settings),
        backlog_ms=round(backlog_ms, 3) if backlog_ms is not None else None,
        models=service.loads(),
        results=dict(results),
        refused=dict(refused),
    )
