"""What a replayed job costs, drawn from what the trace measured.

Per (edge, model), the compute of the jobs that ran on that edge; per (device class,
model), a pool worker's batches: a fixed part and a part per job fitted to every batch the
trace saw, and how slow batches were at each moment against that fit; per edge, how long a
job waited for the broker's placement answers; per link class (same zone, on campus, off
site), the time an offloaded job spent outside the worker: from the placement answer, the
transfer there (to when the worker finished it, from its completion record, so a job that
came back too late to count still teaches the replay), and the result's way back. Where the
trace holds no sample, the figure the node reported (its ``service_ms``) or, for the links,
the placement
parameters' latency and bandwidth stand in.

A recorded job replayed as it was recorded (not a burst's copy of it) takes its own figures
where the trace holds them and it does here what it did live: its acceptance commit, its
wait for the placement answers where it asked, its compute and its commit where it ran on
its edge, its way to the worker and its result's way back where its first attempt goes to
the worker it ran on. Each is what that moment cost that job: the order two jobs of one
volley reached the queue in, and a busy moment that delayed a volley's transfers together,
which draws would shuffle and scatter, are part of what the campus did. Other jobs draw.

A draw is taken among the samples of jobs that arrived within ``WINDOW_S`` of the job
being replayed (when there are at least ``MIN_LOCAL`` of them), so the times follow what
the campus was going through at that moment (a burst that slowed every node shows in the
samples of its seconds, not spread over the whole trace); otherwise among all of them.
Draws come from one seeded generator, in the order the replay asks for them, so a replay
is reproducible.
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right
from collections import defaultdict

from broker.core.links import link_class
from broker.core.params import PlacementParams
from broker.core.scoring import transfer_costs
from sluicegate.twin.trace import JobRecord, Trace

DEFAULT_SERVICE_MS = 50.0  # a model nobody measured
WINDOW_S = 2.0  # draw among jobs that arrived this close to the one replayed ...
MIN_LOCAL = 5  # ... when there are at least this many of them


class Samples:
    """Measured times with the arrival time of their job, for time-local draws."""

    def __init__(self) -> None:
        self._rows: list[tuple[float, float, float]] = []
        self._at: list[float] = []
        self._ms: list[float] = []
        self._also: list[float] = []

    def add(self, at: float, ms: float, also: float | None = None) -> None:
        """A sample of ``ms``, with a second figure of the same job (``also``) drawn with it."""
        self._rows.append((at, ms, ms if also is None else also))

    def freeze(self) -> None:
        self._rows.sort()
        self._at = [a for a, _, _ in self._rows]
        self._ms = [m for _, m, _ in self._rows]
        self._also = [x for _, _, x in self._rows]

    def __len__(self) -> int:
        return len(self._rows)

    def pick(self, rng: random.Random, at: float) -> float:
        return self._ms[self._index(rng, at)]

    def pick_both(self, rng: random.Random, at: float) -> tuple[float, float]:
        i = self._index(rng, at)
        return self._ms[i], self._also[i]

    def _index(self, rng: random.Random, at: float) -> int:
        lo = bisect_left(self._at, at - WINDOW_S)
        hi = bisect_right(self._at, at + WINDOW_S)
        if hi - lo < MIN_LOCAL:
            lo, hi = 0, len(self._ms)
        return lo + rng.randrange(hi - lo)


class Draws:
    """Sampled service and transfer times for a replay of ``trace``."""

    def __init__(self, trace: Trace, params: PlacementParams, seed: int) -> None:
        self._rng = random.Random(seed)
        self._params = params
        header = trace.header
        worker_class = {w.id: w.device_class for w in header.workers}
        worker_zone = {w.id: w.zone for w in header.workers}
        edge_zone = {e.id: e.zone for e in header.edges}
        self._edge: dict[tuple[str, str], Samples] = defaultdict(Samples)
        spans: dict[tuple[str, str], list[tuple[float, int, float]]] = defaultdict(list)
        self._there: dict[int, Samples] = defaultdict(Samples)  # edge to the worker's end
        self._back: dict[int, Samples] = defaultdict(Samples)  # the result's way back
        self._local_overhead: dict[str, Samples] = defaultdict(Samples)
        self._admit: dict[str, Samples] = defaultdict(Samples)  # arrival to acceptance
        self._ask: dict[str, Samples] = defaultdict(Samples)  # waiting for placement answers
        self._edge_spec = {e.id: e.service_ms for e in header.edges}
        self._class_spec: dict[tuple[str, str], float] = {}
        for w in header.workers:
            for model, ms in w.service_ms.items():
                self._class_spec.setdefault((w.device_class, model), ms)
        for job in trace.jobs:
            if job.accepted_ms is not None:
                self._admit[job.edge].add(job.at, job.accepted_ms)
            if job.placement_ms is not None:
                gave_up = 1.0 if job.offload_code == "broker_timeout" else 0.0
                self._ask[job.edge].add(job.at, job.placement_ms, gave_up)
            worker = job.worker or (job.ran_on if job.offloaded else None)
            if worker in worker_class and job.service_ms > 0:
                assert worker is not None
                # Every job a worker ran counts, also one whose result came back too late.
                spans[(worker_class[worker], job.model)].append((job.at, job.batch, job.service_ms))
                link = link_class(edge_zone[job.edge], worker_zone[worker], params.campus_prefix)
                there, back = _way_there(job), _way_back(job)
                if there is not None:
                    self._there[link].add(job.at, there)
                    if back is not None:
                        self._back[link].add(job.at, back)
                elif job.offloaded and job.status == "ok":  # no completion heard: halves
                    half = max(0.0, job.latency_ms - job.queue_ms - job.service_ms) / 2.0
                    self._there[link].add(job.at, half)
                    self._back[link].add(job.at, half)
            elif _ran_on(job, job.edge):
                self._edge[(job.edge, job.model)].add(job.at, job.service_ms, job.device_ms)
                self._local_overhead[job.edge].add(job.at, _outside(job))
        self._shape: dict[tuple[str, str], tuple[float, float]] = {}
        self._pool: dict[tuple[str, str], Samples] = {}
        for key, rows in spans.items():
            fixed, per_job = self._shape[key] = _fit(rows)
            factors = self._pool[key] = Samples()
            for at, n, span in rows:
                factors.add(at, span / (fixed + per_job * n))
        tables = (self._edge, self._pool, self._there, self._back, self._local_overhead)
        for table in (*tables, self._admit, self._ask):
            for samples in table.values():
                samples.freeze()

    def edge_ms(
        self, edge: str, model: str, at: float, own: JobRecord | None = None
    ) -> tuple[float, float]:
        """One job's run on ``edge``: its time on a compute thread, and the part the agent
        measures as its compute (decode, preprocess, inference: what its service-time
        estimate learns from); ``at``: when the job arrived, s into the trace; ``own``: the
        job's record, when it is replayed as recorded."""
        if own is not None and _ran_on(own, edge):
            return own.service_ms, own.device_ms if own.device_ms is not None else own.service_ms
        samples = self._edge.get((edge, model))
        if samples:
            return samples.pick_both(self._rng, at)
        ms = self._edge_spec.get(edge, {}).get(model, DEFAULT_SERVICE_MS)
        return ms, ms

    def admit_ms(self, edge: str, at: float, own: JobRecord | None = None) -> float:
        """From a job's arrival at ``edge`` to its acceptance committed (0: not recorded)."""
        if own is not None and own.accepted_ms is not None:
            return own.accepted_ms
        samples = self._admit.get(edge)
        return samples.pick(self._rng, at) if samples else 0.0

    def ask_ms(self, edge: str, at: float, own: JobRecord | None = None) -> tuple[float, bool]:
        """How long a job of ``edge`` waited for the broker's placement answers, and whether
        the edge gave up waiting (``broker_timeout``); (0, False) when not recorded."""
        if own is not None and own.placement_ms is not None:
            return own.placement_ms, own.offload_code == "broker_timeout"
        samples = self._ask.get(edge)
        if not samples:
            return 0.0, False
        ms, gave_up = samples.pick_both(self._rng, at)
        return ms, gave_up > 0.5

    def edge_overhead_ms(self, edge: str, at: float, own: JobRecord | None = None) -> float:
        """What a local job spends on the edge besides waiting and computing."""
        if own is not None and _ran_on(own, edge):
            return _outside(own)
        samples = self._local_overhead.get(edge)
        return samples.pick(self._rng, at) if samples else 0.0

    def pool_batch_ms(
        self, device_class: str, model: str, jobs: int, spec_ms: float | None, at: float
    ) -> float:
        """A batch of ``jobs`` on a worker of ``device_class``: the batch's shape (a fixed part
        and a part per job, fitted to every batch the trace saw), times how slow the
        worker's batches were around ``at`` against that shape. (Drawn even for a recorded
        job's batch: the twin's batches are not the live ones, and a live batch's slowness
        applied to each twin batch its first job leads misses more than it catches.)"""
        key = (device_class, model)
        factors = self._pool.get(key)
        if factors:
            fixed, per_job = self._shape[key]
            return factors.pick(self._rng, at) * (fixed + per_job * jobs)
        ms = spec_ms if spec_ms is not None else self._class_spec.get(key, DEFAULT_SERVICE_MS)
        return ms * jobs

    def there_ms(
        self,
        origin_zone: str,
        worker_zone: str,
        payload_bytes: int,
        at: float,
        own: JobRecord | None = None,
    ) -> float:
        """An offloaded job's way to the worker, from its placement answer: the edge's
        sending and the transfer."""
        there = _way_there(own) if own is not None else None
        if there is not None:
            return there
        return self._leg(self._there, origin_zone, worker_zone, payload_bytes, at)

    def back_ms(
        self,
        origin_zone: str,
        worker_zone: str,
        payload_bytes: int,
        at: float,
        own: JobRecord | None = None,
    ) -> float:
        """Its result's way back, to when it leaves the edge."""
        back = _way_back(own) if own is not None else None
        if back is not None:
            return back
        return self._leg(self._back, origin_zone, worker_zone, payload_bytes, at)

    def _leg(
        self, table: dict[int, Samples], origin: str, zone: str, payload_bytes: int, at: float
    ) -> float:
        link = link_class(origin, zone, self._params.campus_prefix)
        samples = table.get(link)
        if samples:
            return samples.pick(self._rng, at)
        return transfer_costs(payload_bytes, self._params)[link]

    def measured(self) -> dict[str, int]:
        """How many samples each kind of figure rests on (for the report)."""
        return {
            "edge": sum(map(len, self._edge.values())),
            "pool": sum(map(len, self._pool.values())),
            "links": sum(map(len, self._there.values())) + sum(map(len, self._back.values())),
        }


def _way_there(job: JobRecord) -> float | None:
    """From its placement answer to its run's start on the worker (from the worker's
    completion record), or None where no completion was heard."""
    if job.worker_done_ms is None or job.service_ms <= 0:
        return None
    start = job.worker_done_ms - job.queue_ms - job.service_ms
    return max(0.0, start - (job.placement_ms or 0.0))


def _way_back(job: JobRecord) -> float | None:
    """From its worker's completion to its result leaving the edge, for a job that came back
    in time; else None."""
    if job.worker_done_ms is None or not (job.offloaded and job.status == "ok"):
        return None
    return max(0.0, job.latency_ms - job.worker_done_ms)


def _ran_on(job: JobRecord, edge: str) -> bool:
    """``job`` ran on ``edge`` and its time there was measured."""
    return job.status == "ok" and not job.offloaded and job.ran_on == edge and job.service_ms > 0


def _outside(job: JobRecord) -> float:
    """A local job's time on its edge besides waiting and computing: its commit, its result
    published."""
    return max(0.0, job.latency_ms - job.queue_ms - job.service_ms)


def _fit(rows: list[tuple[float, int, float]]) -> tuple[float, float]:
    """(fixed ms, ms per job) of a batch, least squares over (jobs, span) pairs; both >= 0,
    and all per job when every batch had the same size."""
    n = [float(r[1]) for r in rows]
    y = [r[2] for r in rows]
    mean_n, mean_y = sum(n) / len(n), sum(y) / len(y)
    var = sum((x - mean_n) ** 2 for x in n)
    if var == 0.0:
        return 0.0, max(mean_y / mean_n, 1e-3)
    slope = sum((x - mean_n) * (v - mean_y) for x, v in zip(n, y, strict=True)) / var
    per_job = max(slope, 1e-3)
    fixed = max(mean_y - per_job * mean_n, 0.0)
    return fixed, per_job
