"""What is simulated in a replay: arrivals, the broker's answers, the workers' queues and
batches, the network between them, and failures. Where a job goes and when is decided by
the production code, not here:

* each edge runs the edge agent's own :class:`~edge_agent.sequencer.Sequencer` (its table
  of jobs, its outlook, admission, ``edge_agent.lifecycle.transition``, its pump), whose
  effects :mod:`sluicegate.twin.carrier` carries out on the virtual clock;
* the broker runs ``broker.core.batch``'s turn (``decide_turn``, then ``settle``), the one
  ``broker/service.py`` runs, against the same :class:`~broker.core.fleet.Fleet` under the
  policy and parameters of the run; a request that finds no room waits in the broker's
  waiting-room order (``broker.core.mlfq``) for as long as ``service_rules.answer_by``
  allows. One broker replica: every placement it reserves is granted;
* a job no worker here can take in time may be asked of a sister campus the change names,
  as the broker's forwarder asks (:mod:`sluicegate.twin.peering`, whose peers decide with
  their own broker's code), and its image then crosses the link to the peer's worker;
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
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from broker.core import service_rules
from broker.core.batch import decide_turn, settle
from broker.core.fleet import Fleet
from broker.core.mlfq import MLFQ
from broker.core.mlfq import Waiting as WaitingJob
from broker.core.params import PlacementParams
from broker.core.peering import PeerRefused
from center_pool.batching import Entry as Waiting
from center_pool.batching import ready_batches, start_by
from edge_agent import events as ev
from edge_agent.admission import queue_key
from edge_agent.events import IllegalMove
from edge_agent.jobs import Entry
from edge_agent.load import JobQueue
from edge_agent.rules import Declined, Placement
from edge_agent.sequencer import Sequencer
from policies.evaluate import allowed
from policies.model import Policy
from sluicegate import topics
from sluicegate.twin import strategies
from sluicegate.twin.carrier import SimCarrier
from sluicegate.twin.draws import Draws
from sluicegate.twin.nodes import (
    BROKER_MAX_WAIT_MS,
    EDGE_MAX_WAIT_MS,
    NOTICE_S,
    PLACEMENT_TIMEOUT_S,
    Change,
    Job,
    Outcome,
    SimEdge,
    SimWorker,
)
from sluicegate.twin.peering import PeerPlaced, Sisters
from sluicegate.wire_pool import Completion, PlacementRequest


class Schedule(Protocol):
    """The clock's one door: call ``fn(when, *args)`` at virtual time ``when``."""

    def __call__(self, when: float, fn: Callable[..., None], /, *args: Any) -> None: ...


@dataclass(eq=False, slots=True)
class Asked:
    """A placement request on its way through the twin's broker."""

    job: Job
    attempt: int
    request: PlacementRequest
    delay: float  # until the answer reaches the edge (the round trip the trace measured)
    late: bool  # the edge stops waiting first: it runs the job (broker_timeout)


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
        self.change = change
        self.policy = policy
        self.params = params
        self.draws = draws
        self.edges = edges
        self.workers = workers
        self.fleet = fleet
        self.sisters = sisters
        self.live = jobs  # jobs not yet concluded
        self.outcomes: list[Outcome] = []
        self.refusals: Counter[str] = Counter()
        self.placed_by_pool: Counter[str] = Counter()  # since the last tick (the signal's)
        self._pool_of = {w: p.name for p in policy.pools for w in p.workers}
        self.counters: Counter[str] = Counter()  # the edges' tallies
        self.violations = 0
        self.asked = 0  # placement requests the edges sent
        self.zones: dict[str, Counter[str]] = {}
        self._turn: Counter[str] = Counter()  # round-robin position per model
        wait_s = BROKER_MAX_WAIT_MS / 1000.0  # the broker's waiting room, as it sizes it
        self.room: MLFQ[Asked] = MLFQ(max(wait_s, 1e-3), max(wait_s / 10.0, 1e-4))
        self._carriers = {e: self._edge(edge) for e, edge in edges.items()}

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
        return offload and self.change.strategy != "edge-only"

    def _clock(self) -> float:
        return self.now

    def _defer(self, fn: Callable[[], None]) -> None:
        self.at(self.now, _call, fn)

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
        """An edge asks for a placement: the broker decides at once, and its answer reaches
        the edge after the wait the trace measured for that edge (past the edge's placement
        timeout too, where a busy edge took the answer before its timer: the trace says
        which), or, where the edge gave up waiting (``broker_timeout``), never: the job
        stays, and the late placement is handed back."""
        self.asked += 1
        ms, late = self.draws.ask_ms(job.rec.edge, job.rec.at, job.own)
        delay = ms / 1000.0
        asked = Asked(job, attempt, job.request(reason, local_s), delay, late)
        if late:
            self.refusals["broker_timeout"] += 1
            why = f"no placement answer within {PLACEMENT_TIMEOUT_S * 1000:.0f} ms"
            answer = ev.Answered(attempt, Declined("broker_timeout", why))
            carrier = self._carriers[job.rec.edge]
            self.at(now + PLACEMENT_TIMEOUT_S, carrier.event, job.job_id, answer)
        self._offer(now, asked)

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

    def _offer(self, now: float, asked: Asked) -> None:
        if self.change.strategy != "ours":
            self._offer_other(now, asked)
            return
        turn = decide_turn(
            self.fleet,
            (asked,),
            _request_of,
            self.policy,
            now=now,
            params=self.params,
            hold=self._hold,
            sealable=_unsealed,
            forward=self._forward if self.sisters and self.policy.peers_out() else None,
        )
        granted = [True] * len(turn.placed)  # one replica: nobody takes a slot first
        settled = settle(self.fleet, turn.placed, granted, _request_of, now=now)
        for item, placed in settled.granted:
            self._placed(now, item, placed.worker_id, placed.predicted_ms)
        for refusal in (*turn.refused, *settled.refused):
            self._declined(now, refusal.item, refusal.code, refusal.reason)

    def _offer_other(self, now: float, asked: Asked) -> None:
        """A baseline strategy's choice (``sluicegate.twin.strategies``)."""
        rec, job = asked.job.rec, asked.job
        eligible = strategies.with_room(
            self.fleet,
            self.workers.values(),
            self.policy,
            model=rec.model,
            data_class=rec.data_class,
            origin=job.origin,
        )
        if not eligible:
            self._declined(now, asked, "no_worker", "no worker of the strategy has room")
            return
        worker = strategies.choose(self.change.strategy, eligible, self._turn, rec.model)
        self.fleet.reserve(worker.spec.id, job.job_id, now, rec.model)
        self._placed(now, asked, worker.spec.id, None)

    def _placed(self, now: float, asked: Asked, worker_id: str, predicted: float | None) -> None:
        job, worker = asked.job, self.workers[worker_id]
        self.placed_by_pool[self._pool_of.get(worker_id, "?")] += 1
        if not allowed(self.policy, job.rec.data_class, job.origin, worker.spec.zone).allowed:
            self.violations += 1
        if asked.late:  # the edge gave up first: it hands the placement back as it comes
            self.at(now + asked.delay, self._hand_back, job)
            return
        if job.cancelled == asked.attempt:  # the edge stopped waiting: handed back
            self.fleet.release(job.job_id)
            return
        placement = Placement(worker_id, worker.spec.zone, "", "", b"", predicted)
        self._answer(now, asked, placement)

    def _forward(self, asked: Asked, now: float) -> bool:
        """The broker asks a sister campus for a job it cannot take in time, as its
        forwarder does (:meth:`~sluicegate.twin.peering.Sisters.forward`)."""
        assert self.sisters is not None
        job = asked.job
        waited = now - job.waiting_since if job.waiting_since is not None else 0.0
        return self.sisters.forward(asked.request, now, waited, partial(self._relay, asked))

    def _relay(self, asked: Asked, now: float, answer: PeerPlaced | PeerRefused) -> None:
        """A sister campus's answer, relayed to the edge (a refusal or no answer in time:
        the edge runs the job); nothing hands back a placement the edge stopped waiting for."""
        assert self.sisters is not None
        if isinstance(answer, PeerRefused):
            self._declined(now, asked, answer.code, answer.reason)
            return
        if self.sisters.broke_agreement(asked.job.rec.data_class, answer.worker):
            self.violations += 1
        if asked.late or asked.job.cancelled == asked.attempt:
            return
        campus = topics.campus_of(answer.worker)
        placement = Placement(
            answer.worker, answer.zone, "", "", b"", answer.predicted_ms, campus=campus
        )
        self._answer(now, asked, placement)

    def _hand_back(self, now: float, job: Job) -> None:
        self.fleet.release(job.job_id)

    def _declined(self, now: float, asked: Asked, code: str, reason: str) -> None:
        self.refusals[code] += 1
        if asked.job.cancelled != asked.attempt and not asked.late:
            self._answer(now, asked, Declined(code, reason))

    def _answer(self, now: float, asked: Asked, answer: Placement | Declined) -> None:
        carrier = self._carriers[asked.job.rec.edge]
        event = ev.Answered(asked.attempt, answer)
        self.at(now + asked.delay, carrier.event, asked.job.job_id, event)

    def _hold(self, asked: Asked, now: float) -> bool:
        """The broker's waiting room: a request that found no worker with room waits for
        one (``service_rules.answer_by``), in its multi-level-feedback order."""
        job = asked.job
        since = job.waiting_since if job.waiting_since is not None else now
        by = service_rules.answer_by(
            since,
            now,
            broker_max_wait_ms=BROKER_MAX_WAIT_MS,
            edge_max_wait_ms=EDGE_MAX_WAIT_MS,
            deadline_at=job.deadline,
        )
        if by is None or not self.room.push(
            WaitingJob(job.job_id, job.rec.priority, by, since, asked), now
        ):
            return False
        job.waiting_since = since
        self.at(by, self.room_look)
        return True

    def room_look(self, now: float) -> None:
        """Capacity may have freed, or a wait is over: those whose wait is over run on their
        edge (``no_capacity``); the others, in their turn, are decided again."""
        for gone in self.room.expired(now):
            waited = (now - (gone.item.job.waiting_since or now)) * 1000.0
            why = f"no allowed worker had room within {waited:.0f} ms; run locally"
            self._declined(now, gone.item, "no_capacity", why)
        ready = []
        while (turn := self.room.pop_ready(now)) is not None:
            ready.append(turn.item)
        for asked in ready:  # one look each: one still without room waits again
            self._offer(now, asked)

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
            self.at(
                self._home(worker, now + job.back_s),
                self._back,
                job,
                attempt,
                worker.name,
                "queue_full",
            )
            return
        worker.note()
        self._dispatch(now, worker)

    def _dispatch(self, now: float, worker: SimWorker) -> None:
        if worker.timer is not None and worker.timer <= now:
            worker.timer = None
        wid = worker.name
        free = worker.spec.concurrency - worker.running
        for ready in ready_batches(worker.queue, now, free, _deadline):
            for job, attempt in ready.expired:
                self.at(
                    self._home(worker, now + job.back_s), self._back, job, attempt, wid, "expired"
                )
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
            self.at(
                self._home(worker, now + job.back_s), self._back, job, attempt, worker.name, "ok"
            )
        self._dispatch(now, worker)
        if len(self.room):
            self.room_look(now)

    def lose(self, now: float, worker: SimWorker) -> None:
        """The worker dies: what it held is gone; the broker hears its Last Will and tells
        the edges of the jobs placed there, which offer them again or run them."""
        worker.alive = False
        wid = worker.spec.id
        self.fleet.mark_offline(wid, now)
        lost = ev.WorkerLost
        for job in self._jobs.values():
            if job.worker == wid and not job.done:
                event = lost(job.attempt, f"worker {wid} went offline")
                self.at(now + NOTICE_S, self._carriers[job.rec.edge].event, job.job_id, event)

    def lose_link(self, now: float, campus: str) -> None:
        """The bridge to sister campus ``campus`` is down: the broker tells the edges of the
        jobs out there, which offer them again or run them (``broker.forwarding``)."""
        why = f"the bridge to sister campus {campus} is down"
        for job in self.out_on(campus):
            event = ev.WorkerLost(job.attempt, why)
            self.at(now + NOTICE_S, self._carriers[job.rec.edge].event, job.job_id, event)

    def out_on(self, campus: str) -> list[Job]:
        """The jobs not concluded whose latest attempt went to sister campus ``campus``."""
        return [
            job
            for job in self._jobs.values()
            if job.worker is not None and topics.campus_of(job.worker) == campus and not job.done
        ]


def _request_of(asked: Asked) -> PlacementRequest:
    return asked.request


def _unsealed(request: PlacementRequest) -> None:
    """The twin models no sealing keys: a recorded worker holds the key the policy lists."""
    return


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
