"""Tunables of the placement core, as frozen dataclasses with defaults that suit a campus.

:class:`FleetParams` shape the fleet's index (history kept, forecast horizon, the penalty
for a node heading into saturation, learned service times); they are fixed for the life of
a :class:`~broker.core.fleet.Fleet` because its index stores scores computed with them.
:class:`PlacementParams` shape each decision (links between zones, staleness, how many
candidates an explanation keeps); :class:`ServiceParams` the service's decisions around it
(``broker.core.service_rules``). All validate themselves; the first two can be derived from
:class:`~sluicegate.config.BrokerSettings`. No I/O, no clock.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from broker.core.learned import LearnedPolicy
from broker.core.links import LINK_NAMES
from broker.errors import InvalidParams
from policies.canonical import canonical_json
from sluicegate.config import BrokerSettings


def _check(name: str, value: float, low: float, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidParams(f"{name} = {value!r}; accepted: a number")
    if not (low <= value <= high) or math.isnan(value):
        raise InvalidParams(f"{name} = {value!r}; accepted: {low:g} <= {name} <= {high:g}")


@dataclass(frozen=True, slots=True)
class FleetParams:
    """How the fleet keeps and scores its workers."""

    history: int = 16  # telemetry samples kept per worker
    trend_window: int = 8  # the most recent samples the load trend is fitted over
    trend_min_samples: int = 3  # fewer than this: no trend (slope 0)
    forecast_horizon_s: float = 3.0  # how far ahead the load is extrapolated
    forecast_penalty: float = 1.5  # multiplies the wait when the forecast crosses capacity
    # A reservation older than this when a worker's telemetry arrives is assumed to be in that
    # sample's queue (or done), so it stops counting on top of it.
    absorb_after_s: float = 0.25
    service_alpha: float = 0.2  # EWMA weight of a new service-time observation
    default_service_ms: float = 50.0  # service time when nothing has been learned or reported
    # A worker holding jobs placed here that completes nothing for this many times the
    # expected time of its next batch (and at least stall_floor_s) has stalled (frozen,
    # a hung driver): out of placement, its jobs placed again, until it shows a sign of life.
    stall_factor: float = 3.0
    stall_floor_s: float = 0.06
    silence_half_life_s: float = 2.0  # how fast a worker's longest silence is forgotten
    # A worker that had been idle this long before its oldest held job came (or has never
    # completed one) is starting cold: its first completion may take up to cold_start_s.
    idle_after_s: float = 1.0
    cold_start_s: float = 0.3

    def __post_init__(self) -> None:
        _check("history", self.history, 2, 4096)
        _check("trend_window", self.trend_window, 2, self.history)
        _check("trend_min_samples", self.trend_min_samples, 2, self.trend_window)
        _check("forecast_horizon_s", self.forecast_horizon_s, 0.0, 3600.0)
        _check("forecast_penalty", self.forecast_penalty, 1.0, 1000.0)
        _check("absorb_after_s", self.absorb_after_s, 0.0, 3600.0)
        _check("service_alpha", self.service_alpha, 1e-6, 1.0)
        _check("default_service_ms", self.default_service_ms, 1e-3, 3_600_000.0)
        _check("stall_factor", self.stall_factor, 1.0, 1000.0)
        _check("stall_floor_s", self.stall_floor_s, 1e-3, 3600.0)
        _check("silence_half_life_s", self.silence_half_life_s, 1e-3, 86400.0)
        _check("idle_after_s", self.idle_after_s, 0.0, 86400.0)
        _check("cold_start_s", self.cold_start_s, 0.0, 3600.0)

    @classmethod
    def from_settings(cls, settings: BrokerSettings) -> FleetParams:
        """Defaults scaled to the fleet's telemetry interval (the forecast looks three
        intervals ahead) and the progress watch's settings (``dataclasses.replace`` the
        result to change anything else)."""
        return cls(
            forecast_horizon_s=3.0 * settings.telemetry_interval_s,
            stall_factor=settings.stall_factor,
            stall_floor_s=settings.stall_floor_ms / 1000.0,
        )


@dataclass(frozen=True, slots=True)
class PlacementParams:
    """How one decision is made."""

    # Link latency and bandwidth per link class (same zone, on campus, off site).
    link_latency_ms: tuple[float, float, float] = (0.2, 0.5, 20.0)
    link_mb_per_s: tuple[float, float, float] = (1000.0, 100.0, 10.0)
    campus_prefix: str = "campus"  # zones under "<campus_prefix>/" are on site
    stale_after_s: float = 3.0  # a worker silent this long is offline (3 intervals)
    top_k: int = 3  # ranked candidates kept in each explanation
    # A learned placement policy ordering the candidates every filter passed, and keeping a
    # job on its edge when it says so (broker.core.learned); None: the heuristic alone.
    learned: LearnedPolicy | None = None

    def __post_init__(self) -> None:
        for table in ("link_latency_ms", "link_mb_per_s"):
            if len(getattr(self, table)) != len(LINK_NAMES):
                raise InvalidParams(
                    f"{table} needs {len(LINK_NAMES)} values ({', '.join(LINK_NAMES)}), "
                    f"got {list(getattr(self, table))!r}"
                )
        for i, name in enumerate(LINK_NAMES):
            _check(f"link_latency_ms[{name}]", self.link_latency_ms[i], 0.0, 3_600_000.0)
            _check(f"link_mb_per_s[{name}]", self.link_mb_per_s[i], 1e-6, 1e9)
        _check("stale_after_s", self.stale_after_s, 1e-3, 86_400.0)
        _check("top_k", self.top_k, 1, 100)
        if not self.campus_prefix or "/" in self.campus_prefix:
            raise InvalidParams(
                f"campus_prefix = {self.campus_prefix!r}; accepted: one zone segment, e.g. 'campus'"
            )

    @classmethod
    def from_settings(cls, settings: BrokerSettings) -> PlacementParams:
        """A worker is stale after ``missed_intervals`` telemetry intervals of silence."""
        return cls(stale_after_s=settings.telemetry_interval_s * settings.missed_intervals)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> PlacementParams:
        """Parameters from plain data (a placement file's TOML, a trace's JSON: lists become
        tuples); a field not given keeps its default. :class:`InvalidParams` names an
        unknown field or a value out of range."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidParams(f"unknown {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        values: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        if values.get("learned") is not None:
            values["learned"] = LearnedPolicy.from_mapping(values["learned"], "learned")
        try:
            return cls(**values)
        except TypeError as exc:  # a link table of the wrong length, a string for a number
            raise InvalidParams(str(exc)) from exc

    def describe(self) -> dict[str, object]:
        """The parameters as plain data, for the HTTP API and audit records; a learned
        policy's weights inline, and none named when there is none (so the digest of a
        parameter set without one is what it was before policies could be learned)."""
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.learned is None:
            del out["learned"]
        else:
            out["learned"] = self.learned.describe()
        return out

    def digest(self) -> str:
        """The identity of this parameter set (what a twin verdict is bound to): sha256 of
        its canonical JSON, hex."""
        return hashlib.sha256(canonical_json(self.describe())).hexdigest()


@dataclass(frozen=True, slots=True)
class ServiceParams:
    """The service's decisions around a placement (``broker.core.service_rules``)."""

    # A reservation outlives the token (or the job's deadline) by this much: the worker's
    # completion may still be on its way when either runs out.
    reservation_grace_s: float = 5.0
    # Decisions per request when another replica took the chosen slot each time.
    race_decisions: int = 3
    # Weight of the latest tick in the smoothed arrival rate per pool (EWMA).
    arrivals_weight: float = 0.3

    def __post_init__(self) -> None:
        _check("reservation_grace_s", self.reservation_grace_s, 0.0, 3600.0)
        _check("race_decisions", self.race_decisions, 1, 100)
        _check("arrivals_weight", self.arrivals_weight, 1e-6, 1.0)
