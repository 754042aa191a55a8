"""Short-term load forecast: where a worker's load is heading over the next few intervals.

Load is the jobs a worker holds (queued, running, and reserved for it but not yet in its
telemetry) as a fraction of its capacity. The trend is the least-squares slope of the load
in the recent telemetry samples, against the worker's own timestamps; the forecast
extrapolates today's load by that slope over a horizon. A worker whose forecast reaches
its capacity is *crossing*, and placement penalises it. Pure arithmetic over samples:
no clock, no state, no knowledge of how the penalty is applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from broker.core.params import FleetParams
from broker.core.state import TelemetrySample


@dataclass(frozen=True, slots=True)
class LoadForecast:
    """Load now (with reservations), its trend per second, and the load expected at the
    horizon. ``crosses``: the forecast reaches capacity (load 1.0)."""

    load_now: float
    slope_per_s: float
    predicted: float
    horizon_s: float

    @property
    def crosses(self) -> bool:
        return self.predicted >= 1.0


def trend(samples: Sequence[TelemetrySample], window: int, min_samples: int) -> float:
    """Least-squares slope of load over the last ``window`` samples, in load per second;
    0.0 with fewer than ``min_samples`` samples or when they share one timestamp."""
    recent = samples[-window:]
    n = len(recent)
    if n < min_samples:
        return 0.0
    t0 = recent[0].ts
    sx = sy = sxx = sxy = 0.0
    for s in recent:
        x = s.ts - t0
        y = (s.queue_depth + s.in_flight) / s.capacity
        sx += x
        sy += y
        sxx += x * x
        sxy += x * y
    var = n * sxx - sx * sx
    if var <= 1e-12 * n * sxx:  # one timestamp (or as good as): no trend
        return 0.0
    return (n * sxy - sx * sy) / var


def load_now(sample: TelemetrySample, reserved: int) -> float:
    """What the worker holds now: its last sample plus reservations not yet in it."""
    return (sample.queue_depth + sample.in_flight + reserved) / sample.capacity


def predict(load: float, slope_per_s: float, horizon_s: float) -> float:
    """The load expected ``horizon_s`` from now on the current trend (never below zero)."""
    return max(0.0, load + slope_per_s * horizon_s)


def forecast(
    samples: Sequence[TelemetrySample], reserved: int, params: FleetParams
) -> LoadForecast:
    """The forecast for a worker with ``samples`` (oldest first, at least one)."""
    slope = trend(samples, params.trend_window, params.trend_min_samples)
    now = load_now(samples[-1], reserved)
    horizon = params.forecast_horizon_s
    return LoadForecast(now, slope, predict(now, slope, horizon), horizon)
