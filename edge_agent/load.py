"""The edge agent's own load model: the waiting-job queue and per-model service times.

Pure bookkeeping with no clock and no I/O: the shell pushes and pops jobs, reports how long
each job's compute took and how far its predicted completion was from the real one, and
reads back moving averages (for the completion prediction) and error figures (telemetry).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


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

    def seed(self, model: str, seconds: float) -> None:
        """Start ``model``'s average at a measured prior (counted as no completed job); the
        jobs it runs move it from there. A model already measured here keeps its figure."""
        self._figures.setdefault(model, ModelFigures(seconds, 0))

    def estimate(self, model: str) -> float | None:
        figures = self._figures.get(model)
        return figures.service_s if figures else None

    def snapshot(self) -> dict[str, ModelFigures]:
        return dict(self._figures)


@dataclass(frozen=True, slots=True)
class ErrorFigures:
    n: int
    p50_ms: float  # absolute error
    p90_ms: float
    bias_ms: float  # mean signed error: > 0, jobs finished later than predicted


class PredictionErrors:
    """How far the edge's completion predictions were from what happened, for the jobs
    that ran here: the last ``kept`` errors (seconds, actual minus predicted)."""

    def __init__(self, kept: int = 1024) -> None:
        self._errors: deque[float] = deque(maxlen=kept)

    def observe(self, error_s: float) -> None:
        self._errors.append(error_s)

    def snapshot(self) -> ErrorFigures | None:
        if not self._errors:
            return None
        signed = list(self._errors)
        absolute = sorted(abs(e) for e in signed)
        n = len(absolute)
        p50 = absolute[n // 2] * 1000.0
        p90 = absolute[min(n - 1, int(n * 0.9))] * 1000.0
        return ErrorFigures(n, p50, p90, sum(signed) / n * 1000.0)


class JobQueue(Generic[T]):
    """A bounded priority queue of waiting jobs, ordered by ``key`` (smallest first).

    Ties keep arrival order. ``push`` refuses (returns False) when full, so the caller can
    answer the job instead of letting memory grow.
    """

    def __init__(self, capacity: int, key: Callable[[T], tuple[int, float]]) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity!r}")
        self.capacity = capacity
        self._key = key
        self._heap: list[tuple[tuple[int, float], int, T]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: T, *, force: bool = False) -> bool:
        """Queue ``item``; when full, refuse it unless ``force`` (a job already accepted)."""
        if len(self._heap) >= self.capacity and not force:
            return False
        self._seq += 1
        heapq.heappush(self._heap, (self._key(item), self._seq, item))
        return True

    def pop(self) -> T:
        """The most urgent item; IndexError when empty."""
        return heapq.heappop(self._heap)[2]
