"""The replay: a trace's arrivals through the production decision code, on a virtual clock.

A :class:`Simulation` builds the run's world from the trace and the change: its policy and
placement parameters, its simulated edges and workers, the broker's
:class:`~broker.core.fleet.Fleet` (fed the workers' capabilities, and their telemetry every
interval, built by the worker's own ``center_pool.reporting.telemetry``), and the times the
trace measured (:mod:`sluicegate.twin.draws`). It owns the clock: a heap of timed events
that it runs in order, each arrival and each worker lost entered at its moment, the
interval's tick (telemetry to the fleet, the most jobs each node held, a look at the
broker's waiting room). What each event does, decided with the production code, is
:mod:`sluicegate.twin.events`'.

A :class:`Change` is what a candidate tries: a policy, placement parameters, workers added,
removed or slowed, arrivals repeated (a 2x, 5x or 10x burst), a worker lost at a moment,
or another placement strategy (edge-only, round-robin, least-loaded) in place of ours.
Everything runs on one thread with a heap of timed events and one seeded generator: the
same trace, change and seed give the same :class:`Result`.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from broker.core.fleet import Fleet
from broker.core.params import FleetParams, PlacementParams
from sluicegate.twin.draws import Draws
from sluicegate.twin.events import Events
from sluicegate.twin.nodes import STRATEGIES, Change, Job, Outcome, Result, SimEdge, SimWorker
from sluicegate.twin.trace import JobRecord, Trace, policy_of

__all__ = ["STRATEGIES", "Change", "Outcome", "Result", "Simulation", "digest_of", "replay"]


class Simulation:
    """One replay of ``trace`` under ``change`` with ``seed``; :meth:`run` once."""

    def __init__(self, trace: Trace, change: Change | None = None, *, seed: int = 0) -> None:
        self.change = change = change or Change()
        header = trace.header
        self.t0 = header.started_at
        self.policy = change.policy or policy_of(header)
        recorded = (
            PlacementParams.from_mapping(header.params) if header.params else PlacementParams()
        )
        self.params = change.params or recorded
        if change.learned is not None:  # ours, ordering its candidates by a learned policy
            self.params = replace(self.params, learned=change.learned)
        self.interval = header.telemetry_interval_s
        self.draws = Draws(trace, self.params, seed)
        factors = dict(change.degrade)
        specs = [w for w in header.workers if w.id not in change.remove] + list(change.add)
        self.workers = {w.id: SimWorker(w, factors.get(w.id, 1.0)) for w in specs}
        self.edges = {e.id: SimEdge(e) for e in header.edges}
        self.warnings = tuple(
            f"{w.id} is in no pool of the policy: nothing is placed there"
            for w in change.add
            if self.policy.worker(w.id) is None
        )
        self.fleet = Fleet(FleetParams(forecast_horizon_s=3.0 * self.interval), None, self.policy)
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self._depth: dict[str, list[tuple[float, int]]] = {n: [] for n in self.nodes()}
        self._arrivals = self._expand(trace.jobs, change.burst)
        self.events = Events(
            self._at,
            self._arrivals,
            t0=self.t0,
            change=change,
            policy=self.policy,
            params=self.params,
            draws=self.draws,
            edges=self.edges,
            workers=self.workers,
            fleet=self.fleet,
        )

    def nodes(self) -> list[str]:
        return [*self.edges, *self.workers]

    # -- the clock -------------------------------------------------------------------------

    def _at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, args))

    def _expand(self, jobs: tuple[JobRecord, ...], burst: int) -> list[Job]:
        by_edge: dict[str, list[JobRecord]] = {}
        for rec in jobs:
            by_edge.setdefault(rec.edge, []).append(rec)
        out: list[Job] = []
        for recs in by_edge.values():
            for i, rec in enumerate(recs):
                gap = min(1.0, recs[i + 1].at - rec.at) if i + 1 < len(recs) else 0.0
                for copy in range(burst):
                    at = self.t0 + rec.at + copy * gap / burst
                    deadline = at + rec.deadline_ms / 1000.0 if rec.deadline_ms else None
                    job_id = rec.job_id if copy == 0 else f"{rec.job_id}#{copy}"
                    origin = self.edges[rec.edge].spec.zone
                    out.append(Job(rec, job_id, at, deadline, origin))
        out.sort(key=lambda j: (j.at, j.job_id))
        return out

    def run(self) -> Result:
        now = self.t0
        for w in self.workers.values():
            self.fleet.apply_capabilities(w.capabilities(), now)
        events = self.events
        self._tick(now)
        for job in self._arrivals:
            self._at(job.at, events.arrive, job)
        for worker_id, at in self.change.fail:
            if worker_id in self.workers:
                self._at(self.t0 + at, events.lose, self.workers[worker_id])
        end = now
        while self._heap:
            end, _, fn, args = heapq.heappop(self._heap)
            events.now = end
            fn(end, *args)
        duration = max(end - self.t0, 1e-9)
        return Result(
            outcomes=tuple(sorted(events.outcomes, key=lambda o: (o.at, o.job_id))),
            refusals=dict(sorted(events.refusals.items())),
            violations=events.violations,
            zones={k: dict(sorted(v.items())) for k, v in sorted(events.zones.items())},
            depth={n: tuple(s) for n, s in self._depth.items()},
            busy_s={w.spec.id: w.busy_s for w in self.workers.values()},
            slots={w.spec.id: w.spec.concurrency for w in self.workers.values()},
            duration_s=duration,
            draws=self.draws.measured(),
            warnings=self.warnings,
        )

    def _tick(self, now: float) -> None:
        """Every interval: each worker's telemetry to the fleet, and the most jobs each node
        held during the interval."""
        for w in self.workers.values():
            self._depth[w.spec.id].append((round(now - self.t0, 3), max(w.peak, w.held)))
            w.peak = w.held
            if w.alive:
                self.fleet.apply_telemetry(w.telemetry(now, self.interval), now)
        if len(self.events.room):
            self.events.room_look(now)
        for e in self.edges.values():
            self._depth[e.spec.id].append((round(now - self.t0, 3), max(e.peak, e.held)))
            e.peak = e.held
        if self.events.live > 0:
            self._at(now + self.interval, self._tick)


def replay(trace: Trace, change: Change | None = None, *, seed: int = 0) -> Result:
    """Replay ``trace`` under ``change``."""
    return Simulation(trace, change, seed=seed).run()


def digest_of(result: Result) -> str:
    """A short digest of every outcome, to show two replays are the same."""
    h = hashlib.sha256()
    for o in result.outcomes:
        h.update(f"{o.job_id} {o.status} {o.where} {o.latency_ms}\n".encode())
    return h.hexdigest()[:16]
