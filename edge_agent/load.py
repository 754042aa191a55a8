"""The edge agent's own load model: per-model service times and the queue's order.

Pure bookkeeping with no clock of its own: the shell reports how long each job's compute
took and reads back moving averages for telemetry (and, later, for predicting whether a
job would meet its deadline locally).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelFigures:
    service_s: float
    completed: int


class ServiceTimes:
    """Exponentially weighted moving average of compute time, per model."""

    def __init__(self, alpha: float) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self._alpha = alpha
        self._figures: dict[str, ModelFigures] = {}

    def observe(self, model: str, seconds: float) -> None:
        old = self._figures.get(model)
        if old is None:
            self._figures[model] = ModelFigures(seconds, 1)
            return
        avg = old.service_s + self._alpha * (seconds - old.service_s)
        self._figures[model] = ModelFigures(avg, old.completed + 1)

    def estimate(self, model: str) -> float | None:
        figures = self._figures.get(model)
        return figures.service_s if figures else None

    def snapshot(self) -> dict[str, ModelFigures]:
        return dict(self._figures)
