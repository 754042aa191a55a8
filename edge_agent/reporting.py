"""What an edge agent tells the campus about itself, built from plain figures: its retained
status (the offline copy is its Last Will) and its telemetry every interval.

Pure builders: they never publish and never read a clock (the shell passes ``now`` and its
process's figures).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from edge_agent.load import ErrorFigures, ModelFigures
from sluicegate import topics, wire
from sluicegate.config import EdgeSettings
from sluicegate.transport import Will


def status_message(settings: EdgeSettings, state: Literal["online", "offline"]) -> bytes:
    """The retained status document (``online``/``offline``) for this agent."""
    return wire.dump(wire.node_status(settings.id, "edge", settings.zone, state))


def last_will(settings: EdgeSettings) -> Will:
    return Will(topics.edge_status(settings.id), status_message(settings, "offline"))


@dataclass(frozen=True, slots=True)
class Load:
    """The agent's figures at one moment."""

    now: float
    queue_depth: int
    in_flight: int
    models: Mapping[str, ModelFigures]
    cpu_percent: float
    memory_rss_bytes: int
    memory_percent: float
    results: Mapping[str, int]
    finished: Mapping[str, int]
    dropped_no_response_topic: int
    offloaded: int
    offload_pending: int
    events: Mapping[str, int]
    policy_version: int | None = None
    policy_refused: Mapping[str, int] = field(default_factory=dict)
    prediction: ErrorFigures | None = None


def telemetry(settings: EdgeSettings, load: Load) -> wire.EdgeTelemetry:
    return wire.EdgeTelemetry(
        node=settings.id,
        zone=settings.zone,
        ts=load.now,
        queue_depth=load.queue_depth,
        queue_capacity=settings.queue_size,
        in_flight=load.in_flight,
        concurrency=settings.concurrency,
        models={
            name: wire.ModelLoad(
                service_ms=round(fig.service_s * 1000.0, 3), completed=fig.completed
            )
            for name, fig in load.models.items()
        },
        cpu_percent=load.cpu_percent,
        memory_rss_mb=round(load.memory_rss_bytes / 2**20, 1),
        memory_percent=round(load.memory_percent, 2),
        results=dict(load.results),
        finished=dict(load.finished),
        dropped_no_response_topic=load.dropped_no_response_topic,
        offloaded=load.offloaded,
        offload_pending=load.offload_pending,
        events=dict(load.events),
        policy_version=load.policy_version,
        policy_refused=dict(load.policy_refused),
        prediction=_prediction(load.prediction),
    )


def _prediction(figures: ErrorFigures | None) -> wire.PredictionError | None:
    if figures is None:
        return None
    return wire.PredictionError(
        n=figures.n,
        p50_ms=round(figures.p50_ms, 3),
        p90_ms=round(figures.p90_ms, 3),
        bias_ms=round(figures.bias_ms, 3),
    )
