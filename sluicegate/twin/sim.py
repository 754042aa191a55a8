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
from sluicegate.twin.nodes import (
    STRATEGIES,
    Arrival,
    Change,
    Job,
    Outcome,
    Result,
    SimEdge,
    SimWorker,
)
from sluicegate.twin.peering import Sisters, undescribed
from sluicegate.twin.signal import Signal
from sluicegate.twin.trace import AnnouncedRecord, JobRecord, Trace, policy_of
from sluicegate.wire import EdgeSchedule

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
        self.sisters: Sisters | None = None
        if change.peers:
            self.sisters = Sisters(
                change.peers,
                self.policy,
                self.interval,
                self._at,
                lambda: self.events.live > 0,
                t0=self.t0,
                cuts=change.cuts,
            )
        self.warnings = tuple(
            f"{w.id} is in no pool of the policy: nothing is placed there"
            for w in change.add
            if self.policy.worker(w.id) is None
        ) + tuple(undescribed(self.policy, change.peers))
        if self.sisters is not None:
            self.warnings += self.sisters.warnings
        self.fleet = Fleet(FleetParams(forecast_horizon_s=3.0 * self.interval), None, self.policy)
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self._end = self.t0  # the latest event's time
        self._depth: dict[str, list[tuple[float, int]]] = {n: [] for n in self.nodes()}
        self.arrivals = self._expand(trace.jobs, change.burst)
        self._announced = trace.announced
        self.signal = Signal()
        self._next_seq = 0  # the clock's order number of the first arrival (see start)
        self.events = Events(
            self._at,
            len(self.arrivals),
            t0=self.t0,
            change=change,
            policy=self.policy,
            params=self.params,
            draws=self.draws,
            edges=self.edges,
            workers=self.workers,
            fleet=self.fleet,
            sisters=self.sisters,
        )

    def nodes(self) -> list[str]:
        return [*self.edges, *self.workers, *self._lent()]

    def _lent(self) -> dict[str, SimWorker]:
        """The sister campuses' workers, by the names the edges give them."""
        if self.sisters is None:
            return {}
        return {n: w for p in self.sisters.peers.values() for n, w in p.workers.items()}

    # -- the clock -------------------------------------------------------------------------

    def _at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, args))

    def _expand(self, jobs: tuple[JobRecord, ...], burst: int) -> tuple[Arrival, ...]:
        by_edge: dict[str, list[JobRecord]] = {}
        for rec in jobs:
            by_edge.setdefault(rec.edge, []).append(rec)
        out: list[Arrival] = []
        for recs in by_edge.values():
            for i, rec in enumerate(recs):
                gap = min(1.0, recs[i + 1].at - rec.at) if i + 1 < len(recs) else 0.0
                for copy in range(burst):
                    at = self.t0 + rec.at + copy * gap / burst
                    deadline = at + rec.deadline_ms / 1000.0 if rec.deadline_ms else None
                    job_id = rec.job_id if copy == 0 else f"{rec.job_id}#{copy}"
                    origin = self.edges[rec.edge].spec.zone
                    out.append(Arrival(rec, job_id, at, deadline, origin))
        out.sort(key=lambda j: (j.at, j.job_id))
        return tuple(out)

    def run(self) -> Result:
        self.start()
        self.advance(float("inf"))
        return self.result()

    def start(self) -> None:
        """The workers announce themselves, the first tick, every arrival and worker lost
        entered on the clock; :meth:`advance` then runs it."""
        now = self.t0
        self._end = now
        for w in self.workers.values():
            self.fleet.apply_capabilities(w.capabilities(), now)
        if self.sisters is not None:
            self.sisters.start(now)
        events = self.events
        self._tick(now)
        # Each arrival is entered on the clock as the one before it happens (a copy of the
        # replay then holds only the jobs that have arrived), in the order entering them
        # all now would give: each its order number, reserved here.
        self._next_seq = self._seq + 1
        self._seq += len(self.arrivals)
        if self.arrivals:
            self._enter(0)
        for worker_id, at in self.change.fail:
            if worker_id in self.workers:
                self._at(self.t0 + at, events.lose, self.workers[worker_id])
        for campus, at, _down in self.change.cuts:
            self._at(self.t0 + at, events.lose_link, campus)
        for rec in self._announced:
            self._at(self.t0 + rec.at, self._announce, rec)

    def _enter(self, i: int) -> None:
        heapq.heappush(self._heap, (self.arrivals[i].at, self._next_seq + i, self._arrive, (i,)))

    def _arrive(self, now: float, i: int) -> None:
        if i + 1 < len(self.arrivals):
            self._enter(i + 1)
        self.events.arrive(now, Job.of(self.arrivals[i]))

    def _announce(self, now: float, rec: AnnouncedRecord) -> None:
        edge = self.edges.get(rec.edge)
        zone = edge.spec.zone if edge is not None else ""
        self.signal.announced(EdgeSchedule(node=rec.edge, zone=zone, ts=now, windows=rec.windows))

    def advance(self, until: float) -> None:
        """Run every event before ``until`` (virtual, absolute). A simulation stopped here
        can be copied (``copy.deepcopy``) and each copy runs on alike: the twin's oracle
        tries its futures that way (:mod:`sluicegate.twin.oracle`)."""
        heap, events = self._heap, self.events
        while heap and heap[0][0] < until:
            end, _, fn, args = heapq.heappop(heap)
            events.now = self._end = end
            fn(end, *args)

    @property
    def done(self) -> bool:
        return not self._heap

    def result(self) -> Result:
        events = self.events
        duration = max(self._end - self.t0, 1e-9)
        workers = [*self.workers.values(), *self._lent().values()]
        return Result(
            outcomes=tuple(sorted(events.outcomes, key=lambda o: (o.at, o.job_id))),
            refusals=dict(sorted(events.broker.refusals.items())),
            violations=events.broker.violations,
            zones={k: dict(sorted(v.items())) for k, v in sorted(events.zones.items())},
            depth={n: tuple(s) for n, s in self._depth.items()},
            busy_s={w.name: w.busy_s for w in workers},
            slots={w.name: w.spec.concurrency for w in workers},
            duration_s=duration,
            draws=self.draws.measured(),
            warnings=self.warnings,
            signal={pool: tuple(r) for pool, r in sorted(self.signal.readings.items())},
            peers=self.sisters.result() if self.sisters is not None else {},
        )

    def _tick(self, now: float) -> None:
        """Every interval: each worker's telemetry to the fleet, the scaling signal
        (:mod:`sluicegate.twin.signal`), and the most jobs each node held during the
        interval."""
        for w in self.workers.values():
            self._depth[w.spec.id].append((round(now - self.t0, 3), max(w.peak, w.held)))
            w.peak = w.held
            if w.alive:
                self.fleet.apply_telemetry(w.telemetry(now, self.interval), now)
        if self.sisters is not None:
            for name, w in self._lent().items():
                self._depth[name].append((round(now - self.t0, 3), max(w.peak, w.held)))
                w.peak = w.held
            self.sisters.telemetry(now, self.interval)
        broker = self.events.broker
        if len(broker.room):
            broker.room_look(now)
        placed, turned_away = broker.placed_by_pool, broker.turned_away
        self.signal.tick(now, self.t0, self.interval, placed, turned_away, self.fleet, self.policy)
        placed.clear()
        turned_away.clear()
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
