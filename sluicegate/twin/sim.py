"""The replay: a trace's arrivals through the production decision code, on a virtual clock.

Each recorded arrival enters a simulated edge, which decides as the edge agent does, with
the agent's own functions: room (``rules.has_room``), the completion it predicts here
(``rules.work_ahead`` and ``rules.predict_completion`` over its ``ServiceTimes``), whether
to offer the job (``rules.offer_reason``), to offer it again after a lost attempt
(``rules.retry_reason``), when to rejoin the local queue (``rules.rescue_at``), when an
offloaded job is overdue (``rules.offload_expiry``), in the order of its ``JobQueue``. An
offer goes to the broker's pure core: the same :class:`~broker.core.fleet.Fleet` (fed the
workers' capabilities, their telemetry every interval, built by the worker's own
``center_pool.reporting.telemetry``, and their completions) and the same
:func:`~broker.core.placement.decide`, under the policy and parameters of the run, so
forecast, sub-health and the policy's zones act as they do in production. A worker batches
with the worker's :class:`~center_pool.batching.BatchQueue`. What the trace measured gives
the times (:mod:`sluicegate.twin.draws`).

A :class:`Change` is what a candidate tries: a policy, placement parameters, workers added,
removed or slowed, arrivals repeated (a 2x, 5x or 10x burst), a worker lost at a moment,
or another placement strategy (edge-only, round-robin, least-loaded) in place of ours.
Everything runs on one thread with a heap of timed events and one seeded generator: the
same trace, change and seed give the same :class:`Result`.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from broker.core.fleet import Fleet
from broker.core.params import FleetParams, PlacementParams
from broker.core.placement import Placed, decide
from center_pool.batching import BatchQueue
from center_pool.batching import Entry as Waiting
from center_pool.hardware import Sample
from center_pool.reporting import ServiceStats
from center_pool.reporting import telemetry as worker_telemetry
from edge_agent import rules
from edge_agent.load import JobQueue, ServiceTimes
from policies.evaluate import allowed
from policies.model import Policy
from sluicegate.config import PoolSettings
from sluicegate.twin.draws import DEFAULT_SERVICE_MS, Draws
from sluicegate.twin.trace import EdgeSpec, JobRecord, Trace, WorkerSpec, policy_of
from sluicegate.wire_pool import Completion, ModelCapability, PlacementRequest, WorkerCapabilities

Strategy = Literal["ours", "edge-only", "round-robin", "least-loaded"]
STRATEGIES: tuple[Strategy, ...] = ("ours", "edge-only", "round-robin", "least-loaded")
SHA = "0123456789abcdef" * 4  # payload digest of every replayed request: no image here
MAX_ATTEMPTS, RESULT_TIMEOUT_S, NOTICE_S = 4, 3.0, 0.005


@dataclass(frozen=True)
class Change:
    """What a candidate changes against the trace as recorded (nothing, by default)."""

    policy: Policy | None = None
    params: PlacementParams | None = None
    add: tuple[WorkerSpec, ...] = ()
    remove: tuple[str, ...] = ()
    degrade: tuple[tuple[str, float], ...] = ()  # (worker, factor on its service times)
    burst: int = 1  # each arrival this many times, spread over the gap to the next one
    fail: tuple[tuple[str, float], ...] = ()  # (worker, seconds into the trace) it is lost
    strategy: Strategy = "ours"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One replayed job, as the vision app would have seen it."""

    edge: str
    job_id: str
    data_class: str
    model: str
    at: float  # arrival, s into the trace
    status: str
    where: str | None  # the node that ran it
    offloaded: bool
    latency_ms: float
    in_time: bool
    code: str | None


@dataclass(frozen=True)
class Result:
    """What a replay produced."""

    outcomes: tuple[Outcome, ...]
    refusals: dict[str, int]  # placement refusals by code
    violations: int  # placements the run's policy forbids (always 0 for ``ours``)
    zones: dict[str, dict[str, int]]  # data class -> zone it ran in -> jobs
    depth: dict[str, tuple[tuple[float, int], ...]]  # node -> (s, jobs held) per interval
    busy_s: dict[str, float]  # worker -> seconds of its slots spent computing
    slots: dict[str, int]  # worker -> its compute slots
    duration_s: float
    draws: dict[str, int]


@dataclass(eq=False)
class _Job:
    rec: JobRecord
    job_id: str
    at: float  # absolute, on the virtual clock
    deadline: float | None
    origin: str
    phase: str = "new"  # new, offering, offloaded, done
    local: str | None = None  # None, "queued" or "running" on its edge
    attempt: int = 0
    worker: str | None = None
    back_s: float = 0.0  # the way back from the current attempt's worker
    code: str | None = None
    predicted: float = 0.0


class _Edge:
    def __init__(self, spec: EdgeSpec) -> None:
        self.spec = spec
        self.queue: JobQueue[_Job] = JobQueue(spec.queue_size, _queue_key)
        self.running = 0
        self.ahead: Counter[str] = Counter()
        self.times = ServiceTimes(0.2)
        for model, ms in spec.service_ms.items():
            self.times.seed(model, ms / 1000.0)

    def estimate(self, model: str) -> float:
        return self.times.estimate(model) or DEFAULT_SERVICE_MS / 1000.0

    @property
    def held(self) -> int:
        return sum(self.ahead.values())


def _queue_key(job: _Job) -> tuple[int, float]:
    return (-job.rec.priority, job.deadline if job.deadline is not None else math.inf)


class _Worker:
    def __init__(self, spec: WorkerSpec, factor: float) -> None:
        self.spec = spec
        self.settings = PoolSettings(
            id=spec.id,
            zone=spec.zone,
            device_class=spec.device_class,
            max_batch=spec.max_batch,
            concurrency=spec.concurrency,
            queue_size=max(1, spec.capacity - spec.concurrency * spec.max_batch),
        )
        self.queue: BatchQueue[tuple[_Job, int]] = BatchQueue(
            max_batch=spec.max_batch,
            window_s=spec.batch_window_ms / 1000.0,
            capacity=self.settings.queue_size,
        )
        self.factor = factor
        self.alive = True
        self.running = 0  # batches
        self.in_flight: Counter[str] = Counter()  # jobs running, by model
        self.stats = ServiceStats()
        for model, ms in spec.service_ms.items():
            self.stats.seed(model, ms, ms)
        self.busy_s = 0.0
        self.busy_tick = 0.0
        self.timer: float | None = None

    def capabilities(self) -> WorkerCapabilities:
        s = self.spec
        return WorkerCapabilities(
            worker_id=s.id,
            zone=s.zone,
            device_class=s.device_class,
            providers=s.providers,
            memory_total_mb=s.memory_total_mb,
            models={m: ModelCapability(version="1", sha256=sha) for m, sha in s.models.items()},
            max_batch=s.max_batch,
            concurrency=s.concurrency,
        )


class Simulation:
    """One replay of ``trace`` under ``change`` with ``seed``; :meth:`run` once."""

    def __init__(self, trace: Trace, change: Change | None = None, *, seed: int = 0) -> None:
        self.change = change = change or Change()
        header = trace.header
        self.t0 = header.started_at
        self.policy = change.policy or policy_of(header)
        recorded = PlacementParams(**header.params) if header.params else PlacementParams()  # type: ignore[arg-type]
        self.params = change.params or recorded
        self.interval = header.telemetry_interval_s
        self.draws = Draws(trace, self.params, seed)
        factors = dict(change.degrade)
        specs = [w for w in header.workers if w.id not in change.remove] + list(change.add)
        self.workers = {w.id: _Worker(w, factors.get(w.id, 1.0)) for w in specs}
        self.edges = {e.id: _Edge(e) for e in header.edges}
        self.fleet = Fleet(FleetParams(forecast_horizon_s=3.0 * self.interval), None, self.policy)
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self._live = 0  # jobs not yet concluded
        self._outcomes: list[Outcome] = []
        self._refusals: Counter[str] = Counter()
        self._violations = 0
        self._zones: dict[str, Counter[str]] = {}
        self._depth: dict[str, list[tuple[float, int]]] = {n: [] for n in self.nodes()}
        self._turn: Counter[str] = Counter()  # round-robin position per model
        self._arrivals = self._expand(trace.jobs, change.burst)

    def nodes(self) -> list[str]:
        return [*self.edges, *self.workers]

    # -- the clock -------------------------------------------------------------------------

    def _at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, args))

    def _expand(self, jobs: tuple[JobRecord, ...], burst: int) -> list[_Job]:
        by_edge: dict[str, list[JobRecord]] = {}
        for rec in jobs:
            by_edge.setdefault(rec.edge, []).append(rec)
        out: list[_Job] = []
        for recs in by_edge.values():
            for i, rec in enumerate(recs):
                gap = min(1.0, recs[i + 1].at - rec.at) if i + 1 < len(recs) else 0.0
                for copy in range(burst):
                    at = self.t0 + rec.at + copy * gap / burst
                    deadline = at + rec.deadline_ms / 1000.0 if rec.deadline_ms else None
                    job_id = rec.job_id if copy == 0 else f"{rec.job_id}#{copy}"
                    origin = self.edges[rec.edge].spec.zone
                    out.append(_Job(rec, job_id, at, deadline, origin))
        out.sort(key=lambda j: (j.at, j.job_id))
        return out

    def run(self) -> Result:
        now = self.t0
        for w in self.workers.values():
            self.fleet.apply_capabilities(w.capabilities(), now)
        self._live = len(self._arrivals)
        self._tick(now)
        for job in self._arrivals:
            self._at(job.at, self._arrive, job)
        for worker_id, at in self.change.fail:
            if worker_id in self.workers:
                self._at(self.t0 + at, self._lose, self.workers[worker_id])
        end = now
        while self._heap:
            end, _, fn, args = heapq.heappop(self._heap)
            fn(end, *args)
        duration = max(end - self.t0, 1e-9)
        return Result(
            outcomes=tuple(sorted(self._outcomes, key=lambda o: (o.at, o.job_id))),
            refusals=dict(sorted(self._refusals.items())),
            violations=self._violations,
            zones={k: dict(sorted(v.items())) for k, v in sorted(self._zones.items())},
            depth={n: tuple(s) for n, s in self._depth.items()},
            busy_s={w.spec.id: w.busy_s for w in self.workers.values()},
            slots={w.spec.id: w.spec.concurrency for w in self.workers.values()},
            duration_s=duration,
            draws=self.draws.measured(),
        )

    def _tick(self, now: float) -> None:
        """Every interval: each worker's telemetry to the fleet, and every node's depth."""
        for w in self.workers.values():
            held = len(w.queue) + sum(w.in_flight.values())
            self._depth[w.spec.id].append((round(now - self.t0, 3), held))
            if not w.alive:
                continue
            jobs = Counter(w.queue.depths()) + w.in_flight
            busy = min(1.0, w.busy_tick / (self.interval * w.spec.concurrency))
            w.busy_tick = 0.0
            tel = worker_telemetry(
                w.settings,
                Sample(busy, 0.0, float(w.spec.memory_total_mb), None, None),
                ts=now,
                queue_depth=len(w.queue),
                in_flight=sum(w.in_flight.values()),
                service=w.stats,
                results={},
                refused={},
                backlog_ms=w.stats.backlog_ms(jobs),
            )
            self.fleet.apply_telemetry(tel, now)
        for e in self.edges.values():
            self._depth[e.spec.id].append((round(now - self.t0, 3), e.held))
        if self._live > 0:
            self._at(now + self.interval, self._tick)

    # -- the edge --------------------------------------------------------------------------

    def _outlook(self, edge: _Edge, now: float) -> rules.Outlook:
        ahead = rules.work_ahead(edge.ahead, edge.estimate)
        return rules.Outlook(
            edge_id=edge.spec.id,
            offload=edge.spec.offload and self.change.strategy != "edge-only",
            predicted_done=rules.predict_completion(now, ahead, edge.spec.concurrency, 0.0),
            waiting=len(edge.queue),
            queue_bound=edge.spec.queue_bound,
            max_attempts=MAX_ATTEMPTS,
            max_local_runs=3,
            result_timeout_s=RESULT_TIMEOUT_S,
        )

    def _predict(self, edge: _Edge, job: _Job, now: float) -> rules.Outlook:
        outlook = self._outlook(edge, now)
        done = outlook.predicted_done + edge.estimate(job.rec.model)
        return outlook._replace(predicted_done=done)

    def _arrive(self, now: float, job: _Job) -> None:
        edge = self.edges[job.rec.edge]
        spec = edge.spec
        if not rules.has_room(edge.held, queue_size=spec.queue_size, concurrency=spec.concurrency):
            self._conclude(now, job, "rejected", None, "busy")
            return
        outlook = self._predict(edge, job, now)
        job.predicted = outlook.predicted_done
        reason = rules.offer_reason(job.deadline, outlook)
        if reason is None:
            self._enqueue(now, job)
        else:
            self._offer(now, job, reason)

    def _enqueue(self, now: float, job: _Job) -> None:
        edge = self.edges[job.rec.edge]
        job.local = "queued"
        edge.ahead[job.rec.model] += 1
        edge.queue.push(job, force=True)
        self._pump(now, edge)

    def _leave_local(self, job: _Job) -> None:
        if job.local is not None:
            self.edges[job.rec.edge].ahead[job.rec.model] -= 1
            job.local = None

    def _pump(self, now: float, edge: _Edge) -> None:
        while edge.running < edge.spec.concurrency and len(edge.queue):
            job = edge.queue.pop()
            if job.local != "queued":
                continue  # concluded (or returned) while it waited
            if rules.expiry_reason(job.deadline, now) is not None:
                self._conclude(now, job, "expired", None, "expired")
                continue
            job.local = "running"
            edge.running += 1
            seconds = self.draws.edge_ms(edge.spec.id, job.rec.model) / 1000.0
            self._at(now + seconds, self._ran_here, edge, job, seconds)

    def _ran_here(self, now: float, edge: _Edge, job: _Job, seconds: float) -> None:
        edge.running -= 1
        edge.times.observe(job.rec.model, seconds)
        self._leave_local(job)
        extra = self.draws.edge_overhead_ms(edge.spec.id) / 1000.0
        self._conclude(now + extra, job, "ok", edge.spec.id, job.code, latency_at=now + extra)
        self._pump(now, edge)

    def _conclude(
        self,
        now: float,
        job: _Job,
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
        self._live -= 1
        latency = ((latency_at or now) - job.at) * 1000.0
        deadline_ms = job.rec.deadline_ms
        in_time = status == "ok" and (deadline_ms is None or latency <= deadline_ms)
        offloaded = where is not None and where in self.workers
        self._outcomes.append(
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
            self._zones.setdefault(job.rec.data_class, Counter())[zone] += 1

    # -- offers and the broker -------------------------------------------------------------

    def _offer(self, now: float, job: _Job, reason: str) -> None:
        job.phase = "offering"
        if self.change.strategy == "ours":
            worker, code = self._decide_ours(now, job, reason)
        else:
            worker, code = self._decide_other(job)
        if worker is None:
            self._refusals[code or "no_worker"] += 1
            job.phase, job.code = "new", code
            self._enqueue(now, job)
            return
        if not allowed(self.policy, job.rec.data_class, job.origin, worker.spec.zone).allowed:
            self._violations += 1
        self.fleet.reserve(worker.spec.id, job.job_id, now)
        self._send(now, job, worker)

    def _decide_ours(self, now: float, job: _Job, reason: str) -> tuple[_Worker | None, str | None]:
        rec = job.rec
        sha = rec.sha256 if rec.sha256 and len(rec.sha256) == 64 else None
        request = PlacementRequest(
            job_id=job.job_id,
            edge_id=rec.edge,
            origin_zone=job.origin,
            model=rec.model,
            model_sha256=sha,
            data_class=rec.data_class,
            payload_sha256=SHA,
            payload_bytes=rec.bytes,
            priority=rec.priority,
            deadline_at=job.deadline,
            submitted_at=job.at,
            local_estimate_ms=(job.predicted - now) * 1000.0,
            reason="deadline" if reason == "deadline" else "queue",
        )
        decision = decide(self.fleet, request, self.policy, now=now, params=self.params)
        if isinstance(decision, Placed):
            return self.workers[decision.worker_id], None
        return None, decision.code

    def _eligible(self, job: _Job) -> list[_Worker]:
        rec = job.rec
        out = []
        for w in self.workers.values():
            state = self.fleet.state(w.spec.id)
            latest = state.latest if state is not None else None
            if not w.alive or rec.model not in w.spec.models or latest is None:
                continue
            if not allowed(self.policy, rec.data_class, job.origin, w.spec.zone).allowed:
                continue
            held = latest.queue_depth + latest.in_flight + self.fleet.reserved(w.spec.id)
            if held < latest.capacity:
                out.append(w)
        return out

    def _decide_other(self, job: _Job) -> tuple[_Worker | None, str | None]:
        """Round-robin or least-loaded over the workers the policy allows and the fleet
        shows with room (the baselines a placement strategy is compared with)."""
        eligible = self._eligible(job)
        if not eligible:
            return None, "no_worker"
        if self.change.strategy == "round-robin":
            turn = self._turn[job.rec.model]
            self._turn[job.rec.model] += 1
            return eligible[turn % len(eligible)], None

        def load(w: _Worker) -> float:
            state = self.fleet.state(w.spec.id)
            s = state.latest if state is not None else None
            assert s is not None  # _eligible kept only workers with a sample
            return (s.queue_depth + s.in_flight + self.fleet.reserved(w.spec.id)) / s.capacity

        return min(eligible, key=load), None

    def _send(self, now: float, job: _Job, worker: _Worker) -> None:
        job.phase, job.worker = "offloaded", worker.spec.id
        job.attempt += 1
        outside = self.draws.outside_ms(job.origin, worker.spec.zone, job.rec.bytes) / 1000.0
        job.back_s = outside / 2.0
        self._at(now + outside / 2.0, self._reach, worker, job, job.attempt)
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

    def _current(self, job: _Job, attempt: int) -> bool:
        return job.phase == "offloaded" and job.attempt == attempt

    def _overdue(self, now: float, job: _Job, attempt: int) -> None:
        if not self._current(job, attempt):
            return
        if rules.expiry_reason(job.deadline, now) is not None:
            self._conclude(now, job, "expired", None, "offload_overdue")
            return
        self.fleet.release(job.job_id)
        self._retry(now, job, attempt)

    def _retry(self, now: float, job: _Job, attempt: int) -> None:
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

    def _rescue(self, now: float, job: _Job, attempt: int) -> None:
        if self._current(job, attempt) and job.local is None:
            self._enqueue(now, job)

    def _returned(self, now: float, job: _Job, attempt: int, status: str, where: str) -> None:
        if not self._current(job, attempt) or job.local == "running":
            return  # a stale attempt, or its rescue already runs here: dropped (fencing)
        self._conclude(now, job, status, where if status == "ok" else None, None)

    def _refused_back(self, now: float, job: _Job, attempt: int) -> None:
        if self._current(job, attempt):
            self._refusals["queue_full"] += 1
            job.code = "queue_full"
            self._retry(now, job, MAX_ATTEMPTS)

    # -- the workers -----------------------------------------------------------------------

    def _reach(self, now: float, worker: _Worker, job: _Job, attempt: int) -> None:
        if not worker.alive:
            return  # the broker's notice of the loss moves the job on
        estimate = worker.stats.batch_estimate_s(job.rec.model)
        start_by = None
        if job.deadline is not None:
            start_by = now if estimate is None else job.deadline - estimate
        entry = Waiting((job, attempt), job.rec.model, now, job.rec.priority, start_by)
        if not worker.queue.push(entry):
            self._at(now + job.back_s, self._refused_back, job, attempt)
            return
        self._dispatch(now, worker)

    def _dispatch(self, now: float, worker: _Worker) -> None:
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
            ms = sum(self.draws.pool_job_ms(cls, model, spec_ms) for _ in live) * worker.factor
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
        worker: _Worker,
        model: str,
        live: list[tuple[_Job, int]],
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

    def _lose(self, now: float, worker: _Worker) -> None:
        """The worker dies: what it held is gone; the broker hears its Last Will and tells
        the edges of the jobs placed there, which offer them again or run them."""
        worker.alive = False
        self.fleet.mark_offline(worker.spec.id, now)
        for job in self._arrivals:
            if job.phase == "offloaded" and job.worker == worker.spec.id:
                self._at(now + NOTICE_S, self._lost, job, job.attempt)

    def _lost(self, now: float, job: _Job, attempt: int) -> None:
        if self._current(job, attempt):
            self._retry(now, job, attempt)


def replay(trace: Trace, change: Change | None = None, *, seed: int = 0) -> Result:
    """Replay ``trace`` under ``change``."""
    return Simulation(trace, change, seed=seed).run()


def digest_of(result: Result) -> str:
    """A short digest of every outcome, to show two replays are the same."""
    h = hashlib.sha256()
    for o in result.outcomes:
        h.update(f"{o.job_id} {o.status} {o.where} {o.latency_ms}\n".encode())
    return h.hexdigest()[:16]
