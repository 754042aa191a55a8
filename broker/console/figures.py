"""The console's figures over a sliding window: per line (from the edges' job records) and
per pool (from the workers' completions), and where each data class went.

:class:`Window` keeps what arrived in the last ``window_s`` seconds, bounded in count, and
derives plain dictionaries for the dashboard: jobs per second, local against offloaded and
where, deadline attainment, latency p50/p99 split into queue, inference and the rest
(placement, transfer and delivery), why jobs stayed local in words, batch sizes and service
times per model. Every job point it lists carries its id, so the page links it to the job's
explanation. Pure: the caller passes ``now``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sluicegate import wire
from sluicegate.wire_pool import Completion

MAX_RECORDS = 50_000  # per window, at most: a burst past it keeps the newest
POINTS = 300  # job points per line sent to the page

# Why a job ran on its line PC, in words (codes from the edge's job records).
STAYED_LOCAL: dict[str, str] = {
    "": "not offered: the line PC expected to meet the deadline itself",
    "no_faster_worker": "no pool worker would have finished it sooner than the line PC",
    "no_capacity": "every worker allowed to run it was full",
    "no_worker": "no worker may run the model (none has it, none fits, or all are cordoned)",
    "policy_denied": "the policy keeps its data class out of every zone with a worker",
    "offload_paused": "an operator paused offload from this line",
    "broker_timeout": "the broker did not answer within the line PC's placement timeout",
    "broker_unreachable": "the line PC could not reach the broker",
    "broker_unavailable": "the broker could not reserve a worker (Redis away)",
    "broker_error": "the broker failed deciding; the job ran locally",
    "no_broker": "no campus broker was online",
    "no_policy": "the line PC held no verified policy yet",
    "bad_reply": "the broker's answer could not be used",
    "worker_lost": "the worker died holding it; it ran here instead",
    "result_timeout": "the worker's result was overdue; it ran here to meet the deadline",
    "not_run": "the worker refused it unrun; it ran here",
}


def words_for(code: str | None) -> str:
    return STAYED_LOCAL.get(code or "", f"code {code}")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of ``values`` (sorted here), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return round(ordered[rank - 1], 3)


def _spread(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 0.50), "p99": percentile(values, 0.99)}


@dataclass(frozen=True, slots=True)
class Seen:
    at: float  # when the broker received it
    edge: str
    job: wire.TraceJob


class Window:
    """Job records and completions of the last ``window_s`` seconds."""

    def __init__(self, window_s: float, limit: int = MAX_RECORDS) -> None:
        self.window_s = window_s
        self.jobs: deque[Seen] = deque(maxlen=limit)
        self.completions: deque[tuple[float, Completion]] = deque(maxlen=limit)

    def add_trace(self, trace: wire.EdgeTrace, now: float) -> None:
        for record in trace.records:
            self.jobs.append(Seen(now, trace.node, record))

    def add_completion(self, done: Completion, now: float) -> None:
        self.completions.append((now, done))

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        while self.jobs and self.jobs[0].at < cutoff:
            self.jobs.popleft()
        while self.completions and self.completions[0][0] < cutoff:
            self.completions.popleft()

    def lines(self, now: float) -> dict[str, dict[str, Any]]:
        """Per edge: its jobs in the window, as the dashboard shows them."""
        self._trim(now)
        by_edge: dict[str, list[Seen]] = defaultdict(list)
        for seen in self.jobs:
            by_edge[seen.edge].append(seen)
        return {edge: _line(seen, now, self.window_s) for edge, seen in sorted(by_edge.items())}

    def pools(self, now: float, pool_of: Callable[[str], str]) -> dict[str, dict[str, Any]]:
        """Per pool: completions in the window by model (batch sizes, service and queue
        times), and per worker."""
        self._trim(now)
        grouped: dict[str, list[Completion]] = defaultdict(list)
        for _at, done in self.completions:
            if done.kind == "pool":
                grouped[pool_of(done.worker_id)].append(done)
        return {pool: _pool(done, self.window_s) for pool, done in sorted(grouped.items())}

    def placements(self, now: float, zone_of: Callable[[str], str | None]) -> list[Placement]:
        """Where each job in the window ran: (data class, origin edge, zone it ran in)."""
        self._trim(now)
        out = []
        for seen in self.jobs:
            ran = seen.job.ran_on
            if ran is None:
                continue
            out.append(Placement(seen.job.data_class, seen.edge, zone_of(ran), seen.job.job_id))
        return out


@dataclass(frozen=True, slots=True)
class Placement:
    data_class: str
    edge: str
    zone: str | None  # None: the node it ran on is not known to the broker (shown as "?")
    job_id: str


def _line(seen: list[Seen], now: float, window_s: float) -> dict[str, Any]:
    recent = [s for s in seen if s.at >= now - 10.0]
    local = offloaded = met = with_deadline = 0
    where: Counter[str] = Counter()
    stayed: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    parts: dict[str, list[float]] = {"total": [], "queue": [], "inference": [], "other": []}
    for s in seen:
        job = s.job
        statuses[job.status] += 1
        if job.deadline_ms is not None:
            with_deadline += 1
            met += job.status == "ok" and job.latency_ms <= job.deadline_ms
        if job.ran_on is None:
            continue
        if job.offloaded:
            offloaded += 1
            where[job.ran_on] += 1
        else:
            local += 1
            stayed[job.code or ""] += 1
        parts["total"].append(job.latency_ms)
        parts["queue"].append(job.queue_ms)
        parts["inference"].append(job.service_ms)
        parts["other"].append(max(0.0, job.latency_ms - job.queue_ms - job.service_ms))
    points = [
        {
            "id": s.job.job_id,
            "t": round(s.job.received_at, 3),
            "ms": s.job.latency_ms,
            "on": s.job.ran_on,
            "offloaded": s.job.offloaded,
            "late": s.job.deadline_ms is not None and s.job.latency_ms > s.job.deadline_ms,
        }
        for s in seen[-POINTS:]
    ]
    return {
        "jobs": len(seen),
        "jobs_per_s": round(len(recent) / min(10.0, window_s), 2),
        "local": local,
        "offloaded": offloaded,
        "offloaded_to": dict(where.most_common()),
        "statuses": dict(statuses),
        "attainment": round(met / with_deadline, 4) if with_deadline else None,
        "with_deadline": with_deadline,
        "latency_ms": {name: _spread(values) for name, values in parts.items()},
        "stayed_local": [
            {"code": code or None, "jobs": n, "why": words_for(code)}
            for code, n in stayed.most_common()
        ],
        "points": points,
    }


def _pool(done: list[Completion], window_s: float) -> dict[str, Any]:
    models: dict[str, list[Completion]] = defaultdict(list)
    workers: Counter[str] = Counter()
    for d in done:
        models[d.model].append(d)
        workers[d.worker_id] += 1
    return {
        "jobs": len(done),
        "jobs_per_s": round(len(done) / window_s, 2),
        "by_worker": dict(workers.most_common()),
        "models": {
            model: {
                "jobs": len(items),
                "service_ms": _spread([d.service_ms for d in items]),
                "queue_ms": _spread([d.queue_ms for d in items]),
                "batch_size": _spread([float(d.batch_size) for d in items]),
                "failed": sum(d.status != "ok" for d in items),
            }
            for model, items in sorted(models.items())
        },
    }


def class_matrix(
    placements: Iterable[Placement],
    allowed: Callable[[str, str, str], bool],
    edge_zone: Mapping[str, str],
) -> dict[str, Any]:
    """Jobs by data class and the zone they ran in; a cell is ``forbidden`` when the policy
    in force denies any of its jobs' (class, origin, zone): a red, never-expected cell."""
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    zones: set[str] = set()
    for p in placements:
        zone = p.zone or "?"
        zones.add(zone)
        cell = cells.setdefault((p.data_class, zone), {"jobs": 0, "forbidden": 0, "example": None})
        cell["jobs"] += 1
        origin = edge_zone.get(p.edge)
        if p.zone is not None and origin is not None and not allowed(p.data_class, origin, p.zone):
            cell["forbidden"] += 1
            cell["example"] = cell["example"] or p.job_id
    classes = sorted({c for c, _ in cells})
    return {
        "classes": classes,
        "zones": sorted(zones),
        "cells": [{"class": c, "zone": z, **cell} for (c, z), cell in sorted(cells.items())],
        "forbidden": sum(cell["forbidden"] for cell in cells.values()),
    }
