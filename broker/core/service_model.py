"""Learned service times: how long model M takes on device class D.

Each ``ok`` completion record updates an exponentially weighted moving average per
(model, device class). Until a pair has completions, the average of the service times its
workers report in telemetry stands in; until those arrive, a configured default. The
estimate is per device class rather than per worker on purpose: every worker of a class
then shares one service time, which keeps scores comparable inside the fleet index (see
``broker.core.index``) and lets one worker's history inform its siblings.

Pure and deterministic: observations come in as arguments, nothing reads a clock. The
shell may persist :meth:`ServiceModel.snapshot` and hand it back to :meth:`restore`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

Source = Literal["learned", "reported", "default"]
_EMPTY: Mapping[str, float] = MappingProxyType({})


class ServiceModel:
    """EWMA service time per (model, device class), in milliseconds."""

    __slots__ = ("_alpha", "_by_model", "_default_ms", "_learned", "_observed", "_reported")

    def __init__(self, alpha: float, default_ms: float) -> None:
        self._alpha = alpha
        self._default_ms = default_ms
        self._learned: dict[tuple[str, str], float] = {}
        self._reported: dict[tuple[str, str], float] = {}
        self._observed: dict[tuple[str, str], int] = {}
        # model -> device class -> current estimate, for classes with any figure
        self._by_model: dict[str, dict[str, float]] = {}

    @staticmethod
    def _usable(value: float) -> bool:
        return math.isfinite(value) and value > 0.0

    def _blend(self, table: dict[tuple[str, str], float], key: tuple[str, str], ms: float) -> None:
        old = table.get(key)
        table[key] = ms if old is None else old + self._alpha * (ms - old)

    def _publish(self, model: str, device_class: str) -> None:
        table = self._by_model.get(model)
        if table is None:
            table = self._by_model[model] = {}
        table[device_class] = self.estimate(model, device_class)

    def observe(self, model: str, device_class: str, service_ms: float) -> None:
        """A completed job's service time (from a completion record)."""
        if self._usable(service_ms):
            key = (model, device_class)
            self._blend(self._learned, key, service_ms)
            self._observed[key] = self._observed.get(key, 0) + 1
            self._publish(model, device_class)

    def report(self, model: str, device_class: str, service_ms: float) -> None:
        """A worker's own moving average for ``model`` (from its telemetry)."""
        if self._usable(service_ms):
            self._blend(self._reported, (model, device_class), service_ms)
            if (model, device_class) not in self._learned:
                self._publish(model, device_class)

    @property
    def default_ms(self) -> float:
        return self._default_ms

    def table(self, model: str) -> Mapping[str, float]:
        """``estimate(model, dc)`` for every device class with a learned or reported
        figure (others get :attr:`default_ms`): one lookup per decision on the hot path."""
        return self._by_model.get(model, _EMPTY)

    def estimate(self, model: str, device_class: str) -> float:
        key = (model, device_class)
        value = self._learned.get(key)
        if value is None:
            value = self._reported.get(key)
            if value is None:
                return self._default_ms
        return value

    def source(self, model: str, device_class: str) -> Source:
        """Where :meth:`estimate` comes from, for explanations."""
        key = (model, device_class)
        if key in self._learned:
            return "learned"
        return "reported" if key in self._reported else "default"

    def observations(self, model: str, device_class: str) -> int:
        return self._observed.get((model, device_class), 0)

    def snapshot(self) -> dict[str, list[tuple[str, str, float, int]]]:
        """Everything learned, as plain data (JSON-able) for the shell to persist."""
        return {
            "learned": [
                (m, d, v, self._observed.get((m, d), 0)) for (m, d), v in self._learned.items()
            ],
            "reported": [(m, d, v, 0) for (m, d), v in self._reported.items()],
        }

    def restore(self, snapshot: dict[str, list[tuple[str, str, float, int]]]) -> None:
        """Take back what :meth:`snapshot` returned (values that are not usable are skipped)."""
        for model, dc, value, count in snapshot.get("learned", []):
            if self._usable(value):
                self._learned[(model, dc)] = value
                self._observed[(model, dc)] = count
        for model, dc, value, _ in snapshot.get("reported", []):
            if self._usable(value):
                self._reported[(model, dc)] = value
        for model, dc in (*self._learned, *self._reported):
            self._publish(model, dc)
