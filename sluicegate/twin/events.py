"""What is simulated in a replay: arrivals, the broker's answers, the workers' queues and
batches, the network between them, and failures. Where a job goes and when is decided by
the production code, not here:

* each edge runs the edge agent's own :class:`~edge_agent.sequencer.Sequencer` (its table
  of jobs, its outlook, admission, ``edge_agent.lifecycle.transition``, its pump), whose
  effects :mod:`sluicegate.twin.carrier` carries out on the virtual clock;
* the campus broker (:mod:`sluicegate.twin.campus_broker`) runs ``broker.core.batch``'s
  turn, the one ``broker/service.py`` runs, against the same
  :class:`~broker.core.fleet.Fleet`, with its waiting room, and asks a sister campus the
  change names (:mod:`sluicegate.twin.peering`) for what no worker here can take in time;
  the image of a job placed there crosses the link to the peer's worker;
* a worker batches with the worker's :class:`~center_pool.batching.BatchQueue` and
  ``start_by``, and starts its batches by ``ready_batches``, as the worker's dispatcher
  does; its completions feed the fleet.

What the trace measured gives the times (:mod:`sluicegate.twin.draws`). :class:`Events`
holds the nodes and what they concluded; each handler takes the virtual ``now`` and
schedules what follows on the clock of :mod:`sluicegate.twin.sim`, never one of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial

from broker.core.fleet import Fleet
from broker.core.params import PlacementParams
from broker.core.peering import link_down
from center_pool.batching import Entry as Waiting
from center_pool.batching import ready_batches, start_by
from edge_agent import events as ev
from edge_agent.admission import queue_key
from edge_agent.events import IllegalMove
from edge_agent.jobs import Entry
from edge_agent.load import JobQueue
from edge_agent.rules import Declined
from edge_agent.sequencer import Sequencer
from policies.model import Policy
from sluicegate import topics
from sluicegate.twin.campus_broker import Schedule, SimBroker
from sluicegate.twin.carrier import SimCarrier
from sluicegate.twin.draws import Draws
from sluicegate.twin.nodes import (
    NOTICE_S,
    Change,
    Job,
    Outcome,
    SimEdge,
    SimWorker,
)
from sluicegate.twin.peering import Sisters
from sluicegate.wire_pool import Completion


class Events:
    """The edges, workers and broker of one replay, and each event's handler."""

    def __init__(
        self,
        at: Schedule,
        jobs: int,
        *,
        t0: float,
        change: Change,
        policy: Policy,
        params: PlacementParams,
        draws: Draws,
        edges: dict[str, SimEdge],
        workers: dict[str, SimWorker],
        fleet: Fleet,
        sisters: Sisters | None = None,
    ) -> None:
        """``jobs``: how many arrivals the replay makes; ``sisters``: the sister campuses
        the broker may ask (:mod:`sluicegate.twin.peering`)."""
        self.at = at
        self._jobs: dict[str, Job] = {}  # those that have arrived
        self.t0 = self.now = t0
        self.draws = draws
        self.edges = edges
        self.workers = workers
        self.fleet = fleet
        self.sisters = sisters
        self.live = jobs  # jobs not yet concluded
        self.outcomes: list[Outcome] = []
        self.counters: Counter[str] = Counter()  # the edges' tallies
        self.zones: dict[str, Counter[str]] = {}
        self._carriers = {e: self._edge(edge) for e, edge in edges.items()}
        self.broker = SimBroker(
            at,
            change=change,
            policy=policy,
            params=params,
            draws=draws,
            workers=workers,
            fleet=fleet,
            sisters=sisters,
            edge_event=self._edge_event,
        )

    def _edge(self, edge: SimEdge) -> SimCarrier:
        """The edge's sequencer, as the agent builds it, with the twin's carrier."""
        edge.core = Sequencer(
            edge.spec.id,
            edge.limits,
            queue=JobQueue(edge.spec.queue_size, _entry_key),
            service_s=edge.estimate,
            offload_open=partial(self._offloads, edge.spec.offload),
            clock=self._clock,
            defer=self._defer,
            counters=self.counters,
            gone=_never,
            settled=edge.note,
            illegal=_raise,
        )
        carrier = edge.core.carrier = SimCarrier(edge, self)
        return carrier

    def _offloads(self, offload: bool) -> bool:
        """Whether the edge asks for placements: as it is set, and not under edge-only
        (read at each ask: the oracle changes strategy mid-run)."""
        return offload and self.broker.change.strategy != "edge-only"

    def _clock(self) -> float:
        return self.now

    def _defer(self, fn: Callable[[], None]) -> None:
        self.at(self.now, _call, fn)

    def _edge_event(self, job: Job) -> Callable[..., None]:
        return self._carriers[job.rec.edge].event

    def job(self, job_id: str) -> Job:
        return self._jobs[job_id]

    # -- arrivals and outcomes -------------------------------------------------------------

    def arrive(self, now: float, job: Job) -> None:
        self._jobs[job.job_id] = job
        edge = self.edges[job.rec.edge]
        if edge.core.admit(job.admission(), now) is None:
            self.conclude(job, "rejected", None, "queue_full", now)

    def conclude(
        self, job: Job, status: str, where: str | None, code: str | None, left_at: float
    ) -> None:
        """The job's result leaves its edge at ``left_at``: the app has its outcome. Its
        latency is the app's: from its send, where the trace recorded the leg to the edge
        (the request's ``sent-at``); the way back, which no node measures, is not in it."""
        if job.done:
            return
        job.done = True
        self.live -= 1
        latency = (left_at - job.at) * 1000.0 + (job.rec.inbound_ms or 0.0)
        deadline_ms = job.rec.deadline_ms
        in_time = status == "ok" and (deadline_ms is None or latency <= deadline_ms)
        ran = self.worker(where) if where is not None else None
        offloaded = ran is not None
        self.outcomes.append(
            Outcome(
                job.rec.edge,
                job.job_id,
                job.rec.data_class,
                job.rec.model,
                round(job.at - self.t0, 6),
                status,
                where,
                offloaded,
                round(latency, 3),
                in_time,
                code,
            )
        )
        if where is not None:
            zone = self.edges[where].spec.zone if ran is None else ran.spec.zone
            if ran is not None and ran.home:  # named as its campus names its workers
                zone = topics.peer_worker(zone, ran.home)
            self.zones.setdefault(job.rec.data_class, Counter())[zone] += 1

    # -- what the edges' effects take (sluicegate.twin.carrier.World) ----------------------

    def admit_s(self, job: Job) -> float:
        return self.draws.admit_ms(job.rec.edge, job.rec.at, job.own) / 1000.0

    def run_s(self, edge: SimEdge, job: Job) -> tuple[float, float]:
        """A run's time on a compute thread, and its compute as the agent measures it."""
        wall, compute = self.draws.edge_ms(edge.spec.id, job.rec.model, job.rec.at, job.own)
        return wall / 1000.0, compute / 1000.0

    def overhead_s(self, edge: SimEdge, job: Job) -> float:
        """A local result's commit and publishing: its time on the edge after its run."""
        return self.draws.edge_overhead_ms(edge.spec.id, job.rec.at, job.own) / 1000.0

    def ask(self, now: float, job: Job, attempt: int, reason: str, local_s: float) -> None:
        """An edge asks for a placement: the campus broker's
        (:class:`~sluicegate.twin.campus_broker.SimBroker`)."""
        self.broker.ask(now, job, attempt, reason, local_s)

    def release(self, job: Job, worker: str) -> None:
        if not topics.campus_of(worker):  # a peer's placement is not handed back
            self.fleet.release(job.job_id)

    def worker(self, name: str) -> SimWorker | None:
        """The worker the edges call ``name``: this campus's, or a sister campus's."""
        ours = self.workers.get(name)
        if ours is not None or self.sisters is None:
            return ours
        return self.sisters.worker(name)

    def _home(self, worker: SimWorker, when: float) -> float:
        """When a message due at ``when`` between an edge and ``worker`` arrives: then, or,
        for a sister campus's worker across a cut link, as the link comes back."""
        if worker.home and self.sisters is not None:
            return self.sisters.crossing(worker.home, when)
        return when

    def _fleet_of(self, worker: SimWorker) -> Fleet:
        """The fleet of the broker that placed on ``worker``."""
        return self.sisters.fleet_of(worker.name) if worker.home and self.sisters else self.fleet

    # -- the broker ------------------------------------------------------------------------

    # -- the network and the workers -------------------------------------------------------

    def send(self, now: float, job: Job, attempt: int, worker_id: str) -> None:
        worker = self.worker(worker_id)
        assert worker is not None
        job.attempt, job.worker = attempt, worker_id
        zone = worker.spec.zone
        crossing = (0.0, 0.0)
        if worker.home and self.sisters is not None:  # the campus's leg, then the link's
            zone = job.origin
            crossing = self.sisters.sent(worker_id, job.rec.bytes)
        args = (job.origin, zone, job.rec.bytes, job.rec.at)
        own = job.own if job.rec.worker == worker_id and attempt == 1 else None
        there = self.draws.there_ms(*args, own) / 1000.0 + crossing[0]
        job.back_s = self.draws.back_ms(*args, own) / 1000.0 + crossing[1]
        self.at(self._home(worker, now + there), self._reach, worker, job, attempt)

    def _answer_back(
        self, now: float, worker: SimWorker, job: Job, attempt: int, status: str
    ) -> None:
        """The worker's answer for ``attempt`` sets off to the job's edge."""
        when = self._home(worker, now + job.back_s)
        self.at(when, self._back, job, attempt, worker.name, status)

    def _back(self, now: float, job: Job, attempt: int, worker: str, status: str) -> None:
        """A worker's answer for ``attempt`` reaches the job's edge."""
        if status == "queue_full":
            refused = Declined("queue_full", f"{worker} had no room for the job")
            event: ev.Event = ev.Returned(attempt, worker, refused)
        else:
            job.returned = (status, worker)
            event = ev.Returned(attempt, worker)
        self._carriers[job.rec.edge].event(now, job.job_id, event)

    def _reach(self, now: float, worker: SimWorker, job: Job, attempt: int) -> None:
        if not worker.alive:
            return  # the broker's notice of the loss moves the job on
        estimate = worker.stats.batch_estimate_s(job.rec.model)
        start = start_by(job.deadline, now, estimate)
        entry = Waiting((job, attempt), job.rec.model, now, job.rec.priority, start)
        if not worker.queue.push(entry):
            self._answer_back(now, worker, job, attempt, "queue_full")
            return
        worker.note()
        self._dispatch(now, worker)

    def _dispatch(self, now: float, worker: SimWorker) -> None:
        if worker.timer is not None and worker.timer <= now:
            worker.timer = None
        free = worker.spec.concurrency - worker.running
        for ready in ready_batches(worker.queue, now, free, _deadline):
            for job, attempt in ready.expired:
                self._answer_back(now, worker, job, attempt, "expired")
            live = ready.live
            if not live:
                continue
            cls, model = worker.spec.device_class, ready.model
            spec_ms = worker.spec.service_ms.get(model)
            arrived = live[0][0].rec.at
            ms = self.draws.pool_batch_ms(cls, model, len(live), spec_ms, arrived) * worker.factor
            worker.running += 1
            worker.in_flight[model] += len(live)
            self.at(now + ms / 1000.0, self._batch_done, worker, model, live, ms)
        at = worker.queue.ready_at()
        if at is not None and worker.running < worker.spec.concurrency:
            at = max(at, now)
            if worker.timer is None or at < worker.timer:
                worker.timer = at
                self.at(at, self._dispatch, worker)

    def _batch_done(
        self, now: float, worker: SimWorker, model: str, live: list[tuple[Job, int]], ms: float
    ) -> None:
        if not worker.alive:
            return
        worker.running -= 1
        worker.in_flight[model] -= len(live)
        worker.stats.observe(model, ms, len(live))
        worker.busy_s += ms / 1000.0
        worker.busy_tick += ms / 1000.0
        fleet = self._fleet_of(worker)
        for job, attempt in live:
            done = Completion(
                job_id=job.job_id,
                worker_id=worker.spec.id,
                status="ok",
                model=model,
                service_ms=ms / len(live),
                queue_ms=0.0,
                batch_size=len(live),
                ts=now,
                attempt=attempt,
                edge_id=job.rec.edge,
            )
            fleet.apply_completion(done, now)
            self._answer_back(now, worker, job, attempt, "ok")
        self._dispatch(now, worker)
        if len(self.broker.room):
            self.broker.room_look(now)

    def lose(self, now: float, worker: SimWorker) -> None:
        """The worker dies: what it held is gone; the broker hears its Last Will and tells
        the edges of the jobs placed there, which offer them again or run them."""
        worker.alive = False
        wid = worker.spec.id
        self.fleet.mark_offline(wid, now)
        held = [job for job in self._jobs.values() if job.worker == wid and not job.done]
        self._tell_lost(now, held, f"worker {wid} went offline")

    def lose_link(self, now: float, campus: str) -> None:
        """The bridge to sister campus ``campus`` is down: the broker tells the edges of the
        jobs out there, which offer them again or run them (``broker.forwarding``)."""
        self._tell_lost(now, self.out_on(campus), link_down(campus).reason)

    def _tell_lost(self, now: float, jobs: list[Job], why: str) -> None:
        """The broker's notice that the worker of each of ``jobs`` is lost, at their edges."""
        for job in jobs:
            event = ev.WorkerLost(job.attempt, why)
            self.at(now + NOTICE_S, self._edge_event(job), job.job_id, event)

    def out_on(self, campus: str) -> list[Job]:
        """The jobs not concluded whose latest attempt went to sister campus ``campus``."""
        return [
            job
            for job in self._jobs.values()
            if job.worker is not None and topics.campus_of(job.worker) == campus and not job.done
        ]


def _deadline(item: tuple[Job, int]) -> float | None:
    return item[0].deadline


def _entry_key(entry: Entry) -> tuple[int, float]:
    return queue_key(entry.job)


def _call(now: float, fn: Callable[[], None]) -> None:
    fn()


def _never() -> bool:
    return False


def _raise(exc: IllegalMove) -> None:
    raise exc
