"""What happens in the replay when an edge's, the broker's or a worker's event fires, decided
with the production code.

A simulated edge decides as the edge agent does, with the agent's own functions: room
(``rules.has_room``), the completion it predicts here (``rules.work_ahead`` and
``rules.predict_completion`` over its ``ServiceTimes``), whether to offer the job
(``rules.offer_reason``), to offer it again after a lost attempt (``rules.retry_reason``),
when to rejoin the local queue (``rules.rescue_at``), when an offloaded job is overdue
(``rules.offload_expiry``), in the order of its ``JobQueue``. An offer goes to the broker's
pure core: the same :class:`~broker.core.fleet.Fleet` and the same
:func:`~broker.core.placement.decide`, under the policy and parameters of the run, so
forecast, sub-health and the policy's zones act as they do in production; a request that
finds no room waits in the broker's waiting-room order (``broker.core.mlfq``) for as long as
``service_rules.answer_by`` allows. A worker batches with the worker's
:class:`~center_pool.batching.BatchQueue`, and its completions feed the fleet. What the
trace measured gives the times (:mod:`sluicegate.twin.draws`).

:class:`Events` holds the nodes and what they concluded; each handler takes the virtual
``now`` and schedules what follows on the clock of :mod:`sluicegate.twin.sim`, never one of
its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from broker.core import service_rules
from broker.core.fleet import Fleet
from broker.core.mlfq import MLFQ
from broker.core.mlfq import Waiting as WaitingJob
from broker.core.params import PlacementParams
from broker.core.placement import Placed, decide
from center_pool.batching import Entry as Waiting
from center_pool.batching import start_by
from edge_agent import rules
from policies.evaluate import allowed
from policies.model import Policy
from sluicegate.twin import strategies
from sluicegate.twin.draws import Draws
from sluicegate.twin.nodes import (
    BROKER_MAX_WAIT_MS,
    EDGE_MAX_WAIT_MS,
    MAX_ATTEMPTS,
    NOTICE_S,
    RESULT_TIMEOUT_S,
    Change,
    Job,
    Outcome,
    SimEdge,
    SimWorker,
)
from sluicegate.wire_pool import Completion


class Schedule(Protocol):
    """The clock's one door: call ``fn(when, *args)`` at virtual time ``when``."""

    def __call__(self, when: float, fn: Callable[..., None], /, *args: Any) -> None: ...


class Events:
    """The edges, workers and broker of one replay, and each event's handler."""

    def __init__(
        self,
        at: Schedule,
        jobs: Iterable[Job],
        *,
        t0: float,
        change: Change,
        policy: Policy,
        params: PlacementParams,
        draws: Draws,
        edges: dict[str, SimEdge],
        workers: dict[str, SimWorker],
        fleet: Fleet,
    ) -> None:
        """``jobs``: every arrival of the replay (a lost worker's placed jobs are found
        among them)."""
        self._at = at
        self._arrivals = list(jobs)
        self.t0 = t0
        self.change = change
        self.policy = policy
        self.params = params
        self.draws = draws
        self.edges = edges
        self.workers = workers
        self.fleet = fleet
        self.live = len(self._arrivals)  # jobs not yet concluded
        self.outcomes: list[Outcome] = []
        self.refusals: Counter[str] = Counter()
        self.violations = 0
        self.zones: dict[str, Counter[str]] = {}
        self._turn: Counter[str] = Counter()  # round-robin position per model
        wait_s = BROKER_MAX_WAIT_MS / 1000.0  # the broker's waiting room, as it sizes it
        self.room: MLFQ[tuple[Job, str]] = MLFQ(max(wait_s, 1e-3), max(wait_s / 10.0, 1e-4))

    # -- the edge --------------------------------------------------------------------------

    def _predict(self, edge: SimEdge, job: Job, now: float) -> rules.Outlook:
        """The edge's outlook for ``job`` at ``now``: its predicted completion here."""
        ahead = rules.work_ahead(edge.ahead, edge.estimate)
        done = rules.predict_completion(
            now, ahead, edge.spec.concurrency, edge.estimate(job.rec.model)
        )
        return rules.Outlook(
            edge_id=edge.spec.id,
            offload=edge.spec.offload and self.change.strategy != "edge-only",
            predicted_done=done,
            waiting=len(edge.queue),
            queue_bound=edge.spec.queue_bound,
            max_attempts=MAX_ATTEMPTS,
            max_local_runs=3,
            result_timeout_s=RESULT_TIMEOUT_S,
        )

    def arrive(self, now: float, job: Job) -> None:
        edge = self.edges[job.rec.edge]
        spec = edge.spec
        if not rules.has_room(edge.held, queue_size=spec.queue_size, concurrency=spec.concurrency):
            self._conclude(now, job, "rejected", None, "busy")
            return
        outlook = self._predict(edge, job, now)
        job.predicted = outlook.predicted_done
        reason = rules.offer_reason(job.deadline, outlook)
        # Its acceptance is committed before it runs here (an offer is asked meanwhile), and
        # it counts as work ahead while it is: as long as the edge took then to accept.
        job.admit_s = self.draws.admit_ms(spec.id, job.rec.at) / 1000.0
        # Ahead here while admitted only if it is to run here (edge_agent.jobs.ahead_kind:
        # the replay's broker answers at once, so an offered job is placed, not ahead, or
        # declined and queued).
        run_here = reason is None
        edge.ahead[job.rec.model] += run_here
        edge.offered += not run_here
        edge.note()
        self._at(now + job.admit_s, self._admitted, job, run_here)
        if reason is not None:
            self._offer(now, job, reason)

    def _admitted(self, now: float, job: Job, run_here: bool) -> None:
        edge = self.edges[job.rec.edge]
        edge.ahead[job.rec.model] -= run_here
        edge.offered -= not run_here
        if not run_here or job.phase == "done":
            return
        # Accepted, as the edge routes it then (edge_agent.lifecycle's route): expired,
        # offered when it would be late here now (a burst piles up during the commit), else
        # queued here.
        if rules.expiry_reason(job.deadline, now) is not None:
            self._conclude(now, job, "expired", None, "expired")
            return
        reason = rules.offer_reason(job.deadline, self._predict(edge, job, now))
        if reason is not None:
            self._offer(now, job, reason)
        else:
            self._enqueue(now, job)

    def _enqueue(self, now: float, job: Job) -> None:
        edge = self.edges[job.rec.edge]
        job.local = "queued"
        edge.ahead[job.rec.model] += 1
        edge.queue.push(job, force=True)
        edge.note()
        self._pump(now, edge)

    def _leave_local(self, job: Job) -> None:
        if job.local is not None:
            self.edges[job.rec.edge].ahead[job.rec.model] -= 1
            job.local = None

    def _pump(self, now: float, edge: SimEdge) -> None:
        while edge.running < edge.spec.concurrency and len(edge.queue):
            job = edge.queue.pop()
            if job.local != "queued":
                continue  # concluded (or returned) while it waited
            if rules.expiry_reason(job.deadline, now) is not None:
                self._conclude(now, job, "expired", None, "expired")
                continue
            job.local = "running"
            edge.running += 1
            seconds = self.draws.edge_ms(edge.spec.id, job.rec.model, job.rec.at) / 1000.0
            self._at(now + seconds, self._ran_here, edge, job, seconds)

    def _ran_here(self, now: float, edge: SimEdge, job: Job, seconds: float) -> None:
        edge.running -= 1
        edge.times.observe(job.rec.model, seconds)
        self._leave_local(job)
        # Its result's commit and publishing: what a local job spent on its edge after its run.
        done = now + self.draws.edge_overhead_ms(edge.spec.id, job.rec.at) / 1000.0
        self._conclude(done, job, "ok", edge.spec.id, job.code, latency_at=done)
        self._pump(now, edge)

    def _conclude(
        self,
        now: float,
        job: Job,
        status: str,
        where: str | None,
        code: str | None,
        *,
        latency_at: float | None = None,
    ) -> None:
        if job.phase == "done":
            return
        self._leave_local(job)
        job.phase = "done"
        self.live -= 1
        latency = ((latency_at or now) - job.at) * 1000.0
        deadline_ms = job.rec.deadline_ms
        in_time = status == "ok" and (deadline_ms is None or latency <= deadline_ms)
        offloaded = where is not None and where in self.workers
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
            zone = self.workers[where].spec.zone if offloaded else self.edges[where].spec.zone
            self.zones.setdefault(job.rec.data_class, Counter())[zone] += 1

    # -- offers and the broker -------------------------------------------------------------

    def _offer(self, now: float, job: Job, reason: str) -> None:
        job.phase = "offering"
        if self.change.strategy == "ours":
            worker, code = self._decide_ours(now, job, reason)
        else:
            worker, code = self._decide_other(job)
        if worker is None:
            if code == "no_capacity" and self._hold(now, job, reason):
                return
            self.refusals[code or "no_worker"] += 1
            job.phase, job.code = "new", code
            self._enqueue(now, job)
            return
        if not allowed(self.policy, job.rec.data_class, job.origin, worker.spec.zone).allowed:
            self.violations += 1
        self.fleet.reserve(worker.spec.id, job.job_id, now, job.rec.model)
        self._send(now, job, worker)

    def _hold(self, now: float, job: Job, reason: str) -> bool:
        """The broker's waiting room: a request that found no worker with room waits for
        one (``service_rules.answer_by``), in its multi-level-feedback order."""
        since = job.waiting_since if job.waiting_since is not None else now
        by = service_rules.answer_by(
            since,
            now,
            broker_max_wait_ms=BROKER_MAX_WAIT_MS,
            edge_max_wait_ms=EDGE_MAX_WAIT_MS,
            deadline_at=job.deadline,
        )
        waiting = WaitingJob(job.job_id, job.rec.priority, by, since, (job, reason))
        if by is None or not self.room.push(waiting, now):
            return False
        job.phase, job.waiting_since = "waiting", since
        self._at(by, self.room_look)
        return True

    def room_look(self, now: float) -> None:
        """Capacity may have freed, or a wait is over: those whose wait is over run on their
        edge (``no_capacity``); the others, in their turn, are decided again."""
        for gone in self.room.expired(now):
            job, _ = gone.item
            self.refusals["no_capacity"] += 1
            job.phase, job.code = "new", "no_capacity"
            self._enqueue(now, job)
        ready = []
        while (turn := self.room.pop_ready(now)) is not None:
            ready.append(turn.item)
        for job, reason in ready:  # one look each: one still without room waits again
            self._offer(now, job, reason)

    def _decide_ours(
        self, now: float, job: Job, reason: str
    ) -> tuple[SimWorker | None, str | None]:
        request = job.request(now, reason)
        decision = decide(self.fleet, request, self.policy, now=now, params=self.params)
        if isinstance(decision, Placed):
            return self.workers[decision.worker_id], None
        return None, decision.code

    def _decide_other(self, job: Job) -> tuple[SimWorker | None, str | None]:
        """A baseline strategy's choice (``sluicegate.twin.strategies``)."""
        rec = job.rec
        eligible = strategies.with_room(
            self.fleet,
            self.workers.values(),
            self.policy,
            model=rec.model,
            data_class=rec.data_class,
            origin=job.origin,
        )
        if not eligible:
            return None, "no_worker"
        return strategies.choose(self.change.strategy, eligible, self._turn, rec.model), None

    def _send(self, now: float, job: Job, worker: SimWorker) -> None:
        job.phase, job.worker = "offloaded", worker.spec.id
        job.attempt += 1
        args = (job.origin, worker.spec.zone, job.rec.bytes, job.rec.at)
        there = self.draws.there_ms(*args) / 1000.0
        job.back_s = self.draws.back_ms(*args) / 1000.0
        self._at(now + there, self._reach, worker, job, job.attempt)
        self._at(
            rules.offload_expiry(now, RESULT_TIMEOUT_S, job.deadline),
            self._overdue,
            job,
            job.attempt,
        )
        edge = self.edges[job.rec.edge]
        rescue = rules.rescue_at(job.deadline, now, self._predict(edge, job, now).predicted_done)
        if rescue is not None:
            self._at(rescue, self._rescue, job, job.attempt)

    def _current(self, job: Job, attempt: int) -> bool:
        return job.phase == "offloaded" and job.attempt == attempt

    def _overdue(self, now: float, job: Job, attempt: int) -> None:
        if not self._current(job, attempt):
            return
        if rules.expiry_reason(job.deadline, now) is not None:
            self._conclude(now, job, "expired", None, "offload_overdue")
            return
        self.fleet.release(job.job_id)
        self._retry(now, job, attempt)

    def _retry(self, now: float, job: Job, attempt: int) -> None:
        edge = self.edges[job.rec.edge]
        if job.local is not None:
            job.phase = "new"  # already waiting or running here (rescued)
            return
        why = rules.retry_reason(attempt, job.deadline, self._predict(edge, job, now))
        if why is None:
            job.phase = "new"
            self._enqueue(now, job)
        else:
            self._offer(now, job, why)

    def _rescue(self, now: float, job: Job, attempt: int) -> None:
        if self._current(job, attempt) and job.local is None:
            self._enqueue(now, job)

    def _returned(self, now: float, job: Job, attempt: int, status: str, where: str) -> None:
        if not self._current(job, attempt) or job.local == "running":
            return  # a stale attempt, or its rescue already runs here: dropped (fencing)
        self._conclude(now, job, status, where if status == "ok" else None, None)

    def _refused_back(self, now: float, job: Job, attempt: int) -> None:
        if self._current(job, attempt):
            self.refusals["queue_full"] += 1
            job.code = "queue_full"
            self._retry(now, job, MAX_ATTEMPTS)

    # -- the workers -----------------------------------------------------------------------

    def _reach(self, now: float, worker: SimWorker, job: Job, attempt: int) -> None:
        if not worker.alive:
            return  # the broker's notice of the loss moves the job on
        estimate = worker.stats.batch_estimate_s(job.rec.model)
        start = start_by(job.deadline, now, estimate)
        entry = Waiting((job, attempt), job.rec.model, now, job.rec.priority, start)
        if not worker.queue.push(entry):
            self._at(now + job.back_s, self._refused_back, job, attempt)
            return
        worker.note()
        self._dispatch(now, worker)

    def _dispatch(self, now: float, worker: SimWorker) -> None:
        if worker.timer is not None and worker.timer <= now:
            worker.timer = None
        while worker.running < worker.spec.concurrency:
            batch = worker.queue.pop(now)
            if batch is None:
                break
            live = []
            for job, attempt in batch.items:
                if job.deadline is not None and now >= job.deadline:
                    self._at(
                        now + job.back_s, self._returned, job, attempt, "expired", worker.spec.id
                    )
                else:
                    live.append((job, attempt))
            if not live:
                continue
            cls, model = worker.spec.device_class, batch.model
            spec_ms = worker.spec.service_ms.get(model)
            arrived = live[0][0].rec.at
            ms = self.draws.pool_batch_ms(cls, model, len(live), spec_ms, arrived) * worker.factor
            worker.running += 1
            worker.in_flight[model] += len(live)
            self._at(now + ms / 1000.0, self._batch_done, worker, model, live, ms, now)
        at = worker.queue.ready_at()
        if at is not None and worker.running < worker.spec.concurrency:
            at = max(at, now)
            if worker.timer is None or at < worker.timer:
                worker.timer = at
                self._at(at, self._dispatch, worker)

    def _batch_done(
        self,
        now: float,
        worker: SimWorker,
        model: str,
        live: list[tuple[Job, int]],
        ms: float,
        started: float,
    ) -> None:
        if not worker.alive:
            return
        worker.running -= 1
        worker.in_flight[model] -= len(live)
        worker.stats.observe(model, ms, len(live))
        worker.busy_s += ms / 1000.0
        worker.busy_tick += ms / 1000.0
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
            self.fleet.apply_completion(done, now)
            self._at(now + job.back_s, self._returned, job, attempt, "ok", worker.spec.id)
        self._dispatch(now, worker)
        if len(self.room):
            self.room_look(now)

    def lose(self, now: float, worker: SimWorker) -> None:
        """The worker dies: what it held is gone; the broker hears its Last Will and tells
        the edges of the jobs placed there, which offer them again or run them."""
        worker.alive = False
        self.fleet.mark_offline(worker.spec.id, now)
        for job in self._arrivals:
            if job.phase == "offloaded" and job.worker == worker.spec.id:
                self._at(now + NOTICE_S, self._lost, job, job.attempt)

    def _lost(self, now: float, job: Job, attempt: int) -> None:
        if self._current(job, attempt):
            self._retry(now, job, attempt)
