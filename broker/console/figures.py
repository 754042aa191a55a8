"""The console's figures over a sliding window: per line (from the edges' job records) and
per pool (from the workers' completions), and where each data class went.

:class:`Window` counts what arrived in per-second buckets (one :class:`~collections.Counter`
per node per second) and keeps each node's running totals over the window: a record costs a
few counter updates as it arrives, a bucket is subtracted once as it leaves the window, so a
snapshot costs the same however many jobs the window holds. Latencies are counted in
logarithmic bins 5 % wide, so a p50 or p99 is the upper edge of its bin (within 5 % of the
exact value). From the totals it derives plain dictionaries for the dashboard: jobs per
second, local against offloaded and where, deadline attainment, latency p50/p99 split into
queue, inference and the rest (placement, transfer and delivery), why jobs stayed local in
words, batch sizes and service times per model. The last job points of each line (and the
records of the most recent jobs, for a lookup) carry their ids, so the page links each to
the job's explanation. A job a sister campus's worker ran counts, in where each class went,
under that campus (:func:`node_zone`), allowed there as its agreement says (:func:`may_run`).
Pure: the caller passes ``now``.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from policies.evaluate import allowed, peer_of_origin, peer_origin
from policies.model import Policy
from sluicegate import topics, wire
from sluicegate.wire_pool import Completion

POINTS = 300  # job points per line sent to the page
RECENT = 10_000  # job records kept for a lookup by id
BIN_RATIO = 1.05  # latency bins: each 5 % wider than the one below
FLOOR_MS = 0.1
PARTS = ("total", "queue", "inference", "other")
RAN = ("ok", "failed")  # completion statuses of jobs that went into the model
Key = tuple[Any, ...]  # ("jobs",), ("to", worker), ("h", part, bin), ...
JOBS, LOCAL, OFFLOADED, DEADLINE, MET = (
    ("jobs",),
    ("local",),
    ("offloaded",),
    ("deadline",),
    ("met",),
)
_LOG_RATIO = math.log(BIN_RATIO)

# Why a job ran on its line PC, in words (codes from the edge's job records).
STAYED_LOCAL: dict[str, str] = {
    "": "not offered: the line PC expected to meet the deadline itself",
    "no_faster_worker": "no pool worker would have finished it sooner than the line PC",
    "kept_local": "the learned placement policy kept it on the line PC, which had time for it",
    "no_capacity": "every worker allowed to run it was full",
    "seal_unavailable": "its class is confidential; no worker that fits has a listed sealing key",
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


def bin_of(ms: float) -> int:
    if ms <= FLOOR_MS:
        return 0
    return int(math.log(ms / FLOOR_MS) / _LOG_RATIO) + 1


def bin_top(index: int) -> float:
    """The upper edge of a bin, ms."""
    return 0.0 if index == 0 else round(FLOOR_MS * BIN_RATIO**index, 3)


def percentile(bins: Mapping[int, int], q: float) -> float | None:
    """Nearest-rank percentile of the values counted in ``bins`` (None when empty)."""
    n = sum(bins.values())
    if not n:
        return None
    rank = max(1, math.ceil(q * n))
    seen = 0
    for index in sorted(bins):
        seen += bins[index]
        if seen >= rank:
            return bin_top(index)
    return None  # unreachable: the counts sum to n


def _spread(bins: Mapping[int, int]) -> dict[str, float | None]:
    return {"p50": percentile(bins, 0.50), "p99": percentile(bins, 0.99)}


class Rolling:
    """Per-second buckets of one node's counts, and their totals over the window."""

    __slots__ = ("buckets", "totals")

    def __init__(self) -> None:
        self.buckets: deque[tuple[int, Counter[Key]]] = deque()
        self.totals: Counter[Key] = Counter()

    def bucket(self, now: float) -> Counter[Key]:
        second = int(now)
        if not self.buckets or self.buckets[-1][0] != second:
            self.buckets.append((second, Counter()))
        return self.buckets[-1][1]

    def add(self, now: float, counts: Counter[Key]) -> None:
        self.bucket(now).update(counts)
        self.totals.update(counts)

    def trim(self, cutoff: float) -> None:
        while self.buckets and self.buckets[0][0] < cutoff:
            _second, gone = self.buckets.popleft()
            self.totals.subtract(gone)
        if not self.buckets:
            self.totals.clear()


@dataclass(frozen=True, slots=True)
class Seen:
    edge: str
    job: wire.TraceJob


def _count(c: Counter[Key], job: wire.TraceJob) -> None:
    """Add one job record's counts to ``c``."""
    c[JOBS] += 1
    c[("status", job.status)] += 1
    if job.deadline_ms is not None:
        c[DEADLINE] += 1
        if job.status == "ok" and job.latency_ms <= job.deadline_ms:
            c[MET] += 1
    if job.ran_on is None:
        return
    if job.offloaded:
        c[OFFLOADED] += 1
        c[("to", job.ran_on)] += 1
    else:
        c[LOCAL] += 1
        c[("stayed", job.code or "")] += 1
    total, queue, service = job.latency_ms, job.queue_ms, job.service_ms
    c[("h", "total", bin_of(total))] += 1
    c[("h", "queue", bin_of(queue))] += 1
    c[("h", "inference", bin_of(service))] += 1
    c[("h", "other", bin_of(total - queue - service))] += 1
    c[("class", job.data_class, job.ran_on)] += 1


class Window:
    """Job records and completions of the last ``window_s`` seconds, counted."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._lines: dict[str, Rolling] = {}
        self._workers: dict[str, Rolling] = {}
        self._points: dict[str, deque[tuple[float, dict[str, Any]]]] = {}  # (arrived, point)
        self._examples: dict[tuple[str, str, str], str] = {}  # (edge, class, node) -> job id
        self._recent: OrderedDict[str, Seen] = OrderedDict()

    # -- intake --------------------------------------------------------------------------

    def add_trace(self, trace: wire.EdgeTrace, now: float) -> None:
        edge = trace.node
        rolling = self._lines.setdefault(edge, Rolling())
        points = self._points.setdefault(edge, deque(maxlen=POINTS))
        counts: Counter[Key] = Counter()
        for job in trace.records:
            _count(counts, job)
            late = job.deadline_ms is not None and job.latency_ms > job.deadline_ms
            points.append(
                (
                    now,
                    {
                        "id": job.job_id,
                        "t": round(job.received_at, 3),
                        "ms": job.latency_ms,
                        "on": job.ran_on,
                        "offloaded": job.offloaded,
                        "late": late,
                    },
                )
            )
            if job.ran_on is not None:
                self._examples[(edge, job.data_class, job.ran_on)] = job.job_id
            self._recent[job.job_id] = Seen(edge, job)
            self._recent.move_to_end(job.job_id)
        while len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        rolling.add(now, counts)

    def add_completion(self, done: Completion, now: float) -> None:
        if done.kind != "pool":
            return
        m = done.model
        counts: Counter[Key] = Counter(
            {
                ("jobs", m): 1,
                ("status", m, done.status): 1,
                ("h", "queue", m, bin_of(done.queue_ms)): 1,
            }
        )
        if done.status in RAN:  # a job refused unrun (expired, rejected) took no service
            counts[("h", "service", m, bin_of(done.service_ms))] = 1
            counts[("batch", m, done.batch_size)] = 1
        self._workers.setdefault(done.worker_id, Rolling()).add(now, counts)

    def find(self, job_id: str) -> Seen | None:
        """A recent job's record, as its edge sent it."""
        return self._recent.get(job_id)

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        for rolling in (*self._lines.values(), *self._workers.values()):
            rolling.trim(cutoff)

    # -- figures -----------------------------------------------------------------------------

    def lines(self, now: float) -> dict[str, dict[str, Any]]:
        """Per edge: its jobs in the window, as the dashboard shows them."""
        self._trim(now)
        out = {}
        for edge, rolling in sorted(self._lines.items()):
            if rolling.buckets:
                out[edge] = self._line(edge, rolling, now)
        return out

    def _line(self, edge: str, rolling: Rolling, now: float) -> dict[str, Any]:
        t = rolling.totals
        where: Counter[str] = Counter()
        stayed: Counter[str] = Counter()
        statuses: Counter[str] = Counter()
        parts: dict[str, Counter[int]] = {p: Counter() for p in PARTS}
        for key, n in t.items():
            if n <= 0:
                continue
            kind = key[0]
            if kind == "to":
                where[key[1]] += n
            elif kind == "stayed":
                stayed[key[1]] += n
            elif kind == "status":
                statuses[key[1]] += n
            elif kind == "h":
                parts[key[1]][key[2]] += n
        recent = sum(c[("jobs",)] for second, c in rolling.buckets if second >= now - 10.0)
        deadline = t[("deadline",)]
        cutoff = now - self.window_s
        points = [p for at, p in self._points.get(edge, ()) if at >= cutoff]
        return {
            "jobs": t[("jobs",)],
            "jobs_per_s": round(recent / min(10.0, self.window_s), 2),
            "local": t[("local",)],
            "offloaded": t[("offloaded",)],
            "offloaded_to": dict(where.most_common()),
            "statuses": dict(statuses),
            "attainment": round(t[("met",)] / deadline, 4) if deadline else None,
            "with_deadline": deadline,
            "latency_ms": {name: _spread(bins) for name, bins in parts.items()},
            "stayed_local": [
                {"code": code or None, "jobs": n, "why": words_for(code)}
                for code, n in stayed.most_common()
            ],
            "points": points,
        }

    def pools(self, now: float, pool_of: Callable[[str], str]) -> dict[str, dict[str, Any]]:
        """Per pool: completions in the window by model (batch sizes, service and queue
        times), and per worker."""
        self._trim(now)
        grouped: dict[str, Counter[Key]] = {}
        by_worker: dict[str, Counter[str]] = {}
        for worker, rolling in sorted(self._workers.items()):
            pool = pool_of(worker)
            grouped.setdefault(pool, Counter()).update(rolling.totals)
            jobs = sum(n for k, n in rolling.totals.items() if k[0] == "jobs")
            if jobs > 0:
                by_worker.setdefault(pool, Counter())[worker] = jobs
        return {
            pool: _pool(t, by_worker.get(pool, Counter()), self.window_s)
            for pool, t in sorted(grouped.items())
            if any(k[0] == "jobs" and n > 0 for k, n in t.items())
        }

    def placements(self) -> list[Placement]:
        """Where the jobs in the window ran: (data class, origin edge, node), counted."""
        out = []
        for edge, rolling in self._lines.items():
            for key, n in rolling.totals.items():
                if key[0] == "class" and n > 0:
                    _kind, data_class, node = key
                    example = self._examples.get((edge, data_class, node))
                    out.append(Placement(data_class, edge, node, n, example))
        return out


def _model_figures() -> dict[str, Any]:
    """A model's jobs on a pool, by how each ended: ``ok`` and ``failed`` (the model or the
    worker failed it) ran; ``expired`` and ``rejected`` were refused unrun."""
    return {"jobs": 0, "ok": 0, "failed": 0, "expired": 0, "rejected": 0}


def _pool(t: Counter[Key], workers: Counter[str], window_s: float) -> dict[str, Any]:
    models: dict[str, dict[str, Any]] = {}
    service: dict[str, Counter[int]] = {}
    queue: dict[str, Counter[int]] = {}
    batch: dict[str, Counter[int]] = {}
    for key, n in t.items():
        if n <= 0:
            continue
        kind = key[0]
        if kind == "jobs":
            models.setdefault(key[1], _model_figures())["jobs"] += n
        elif kind == "status":
            models.setdefault(key[1], _model_figures())[key[2]] += n
        elif kind == "h":
            which = service if key[1] == "service" else queue
            which.setdefault(key[2], Counter())[key[3]] += n
        elif kind == "batch":
            batch.setdefault(key[1], Counter())[key[2]] += n
    total = sum(m["jobs"] for m in models.values())
    for model, figures in models.items():
        sizes = batch.get(model, Counter())
        figures["service_ms"] = _spread(service.get(model, Counter()))
        figures["queue_ms"] = _spread(queue.get(model, Counter()))
        figures["batch_size"] = {
            "p50": _exact(sizes, 0.50),
            "p99": _exact(sizes, 0.99),
        }
    return {
        "jobs": total,
        "jobs_per_s": round(total / window_s, 2),
        "by_worker": dict(workers.most_common()),
        "models": dict(sorted(models.items())),
    }


def _exact(counts: Mapping[int, int], q: float) -> float | None:
    """Nearest-rank percentile of small integers counted exactly (batch sizes)."""
    n = sum(counts.values())
    if not n:
        return None
    rank, seen = max(1, math.ceil(q * n)), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return float(value)
    return None  # unreachable


@dataclass(frozen=True, slots=True)
class Placement:
    data_class: str
    edge: str
    node: str  # the node it ran on
    jobs: int
    example: str | None  # one such job's id


def class_matrix(
    placements: Iterable[Placement],
    zone_of: Callable[[str], str | None],
    allowed: Callable[[str, str, str], bool],
    edge_zone: Mapping[str, str],
) -> dict[str, Any]:
    """Jobs by data class and the zone they ran in; a cell is ``forbidden`` when the policy
    in force denies any of its jobs' (class, origin, zone): a red, never-expected cell. A
    node whose zone the broker does not know counts under "?"."""
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    for p in placements:
        zone = zone_of(p.node)
        cell = cells.setdefault(
            (p.data_class, zone or "?"), {"jobs": 0, "forbidden": 0, "example": None}
        )
        cell["jobs"] += p.jobs
        origin = edge_zone.get(p.edge)
        if zone is not None and origin is not None and not allowed(p.data_class, origin, zone):
            cell["forbidden"] += p.jobs
            cell["example"] = cell["example"] or p.example
    return {
        "classes": sorted({c for c, _ in cells}),
        "zones": sorted({z for _, z in cells}),
        "cells": [{"class": c, "zone": z, **cell} for (c, z), cell in sorted(cells.items())],
        "forbidden": sum(cell["forbidden"] for cell in cells.values()),
    }


def node_zone(zones: dict[str, str], node: str) -> str | None:
    """A node's zone; a sister campus's worker (``<worker>@<campus>``) counts under that
    campus, spelt as a peer's origin is (``peer:<campus>``)."""
    campus = topics.campus_of(node)
    return peer_origin(campus) if campus else zones.get(node)


def may_run(policy: Policy, data_class: str, origin: str, target: str) -> bool:
    """Whether the policy allows a job of ``data_class`` from ``origin`` to run in
    ``target``; on a sister campus, whether the agreement lists the class."""
    campus = peer_of_origin(target)
    if campus:
        entry = policy.peers.get(campus)
        return entry is not None and data_class in entry.send.classes
    return allowed(policy, data_class, origin, target).allowed
