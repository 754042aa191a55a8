"""The replay's parts: what a candidate changes, the simulated edges, workers and jobs,
and what a replay produces.

Plain state, no decisions: :mod:`sluicegate.twin.events` moves jobs between these with the
production functions. An edge holds the agent's own ``JobQueue`` (its order) and
``ServiceTimes`` (its estimates, seeded from the node's figures); a worker the worker's
``BatchQueue`` and ``ServiceStats`` and its ``PoolSettings``, from which the worker's own
telemetry builder reports it. ``unsealed`` stands for the sealing keys the twin does not
model, in the campus's placement turn and its sister campuses' alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

from broker.core.learned import LearnedPolicy
from broker.core.params import PlacementParams
from center_pool.batching import BatchQueue
from center_pool.hardware import Sample
from center_pool.reporting import ServiceStats
from center_pool.reporting import telemetry as worker_telemetry
from edge_agent.admission import Job as AdmittedJob
from edge_agent.events import Event
from edge_agent.load import ServiceTimes
from edge_agent.sequencer import Sequencer, limits_of
from policies.model import Policy
from sluicegate import topics
from sluicegate.config import BrokerSettings, EdgeSettings, OffloadSettings, PoolSettings
from sluicegate.twin.draws import DEFAULT_SERVICE_MS
from sluicegate.twin.signal import Reading
from sluicegate.twin.trace import EdgeSpec, JobRecord, WorkerSpec
from sluicegate.vision.image import ImageInfo
from sluicegate.wire_pool import (
    ModelCapability,
    PlacementRequest,
    WorkerCapabilities,
    WorkerTelemetry,
)

Strategy = Literal["ours", "edge-only", "round-robin", "least-loaded"]
STRATEGIES: tuple[Strategy, ...] = ("ours", "edge-only", "round-robin", "least-loaded")
SHA = "0123456789abcdef" * 4  # payload digest of every replayed request: no image here
NOTICE_S = 0.005
NO_IMAGE = ImageInfo("jpeg", 0, 0)
# How long a request that found no room may wait in the broker's waiting room: the broker's
# bound and the edge's (half its placement timeout, as the edge asks), at their defaults.
BROKER_MAX_WAIT_MS = BrokerSettings().max_wait_ms
EDGE_MAX_WAIT_MS = OffloadSettings().placement_timeout_ms / 2.0
# How long an edge waits for the broker's answer before it runs the job (the default).
PLACEMENT_TIMEOUT_S = OffloadSettings().placement_timeout_ms / 1000.0
# An edge's sequencing figures at the agent's defaults (attempts, local runs, result timeout).
DEFAULT_LIMITS = limits_of(EdgeSettings(), OffloadSettings())


def unsealed(_request: PlacementRequest) -> None:
    """The workers a request's images may be sealed to, for the placement turn: the twin
    models no sealing keys (every worker holds the key its policy lists), so no filter."""
    return


@dataclass(frozen=True)
class PeerSpec:
    """A sister campus as a replay simulates it: its policy (whose ``[peers]`` entry for
    this campus is its half of the agreement: the twin takes both halves as signed), the
    workers it would lend, the link's round trip and throughput, and the placement
    parameters of its broker."""

    policy: Policy
    workers: tuple[WorkerSpec, ...]
    rtt_s: float
    bytes_per_s: float
    params: PlacementParams = field(default_factory=PlacementParams)

    @property
    def campus(self) -> str:
        return self.policy.campus


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
    learned: LearnedPolicy | None = None  # ours, ordering its candidates by a learned policy
    peers: tuple[PeerSpec, ...] = ()  # sister campuses the campus may ask
    cuts: tuple[tuple[str, float, float], ...] = ()  # (sister campus, s into the trace, s down)


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

    def __deepcopy__(self, memo: dict[int, Any]) -> Outcome:
        return self  # frozen, of immutable fields: a copy of a replay shares it


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
    warnings: tuple[str, ...] = ()  # what in the change cannot work as the engineer meant
    # pool -> the scaling signal each interval, as the broker's /metrics would say it
    signal: dict[str, tuple[Reading, ...]] = field(default_factory=dict)
    # sister campus -> its asks' outcomes (asked, placed, refused codes, timeout), images
    # sent there, and violations of its agreement (always 0)
    peers: dict[str, dict[str, int]] = field(default_factory=dict)


class Arrival(NamedTuple):
    """One arrival the replay will make: a recorded job, or a burst's copy of it."""

    rec: JobRecord
    job_id: str
    at: float  # absolute, on the virtual clock
    deadline: float | None
    origin: str


@dataclass(eq=False)
class Job:
    """One replayed arrival: its record, and what the simulated parts keep of it beside the
    edge's own :class:`~edge_agent.events.Life` (which its edge's sequencer holds)."""

    rec: JobRecord
    job_id: str
    at: float  # absolute, on the virtual clock
    deadline: float | None
    origin: str
    back_s: float = 0.0  # the way back from the current attempt's worker
    waiting_since: float | None = None  # when it first found no room (the waiting room)
    cancelled: int = 0  # the attempt whose placement the edge stopped waiting for
    worker: str | None = None  # where its latest attempt was sent
    attempt: int = 0  # ... as which attempt
    held: list[Event] = field(default_factory=list)  # returns before its acceptance landed
    returned: tuple[str, str] = ("ok", "")  # the return being concluded: status, worker
    # The result being committed: status, where it ran, its code, when it leaves the edge.
    result: tuple[str, str | None, str | None, float] | None = None
    done: bool = False

    @classmethod
    def of(cls, a: Arrival) -> Job:
        return cls(a.rec, a.job_id, a.at, a.deadline, a.origin)

    @property
    def own(self) -> JobRecord | None:
        """Its record, when it is the recorded job itself (not a burst's copy of it): its
        own measured figures then stand for it (``sluicegate.twin.draws``)."""
        return self.rec if self.job_id == self.rec.job_id else None

    def admission(self) -> AdmittedJob:
        """The job as the edge agent holds it once admitted (no image here)."""
        rec = self.rec
        return AdmittedJob(
            self.job_id,
            rec.model,
            b"",
            NO_IMAGE,
            "",
            None,
            rec.priority,
            rec.data_class,
            self.at,
            self.deadline,
        )

    def request(self, reason: str, local_s: float) -> PlacementRequest:
        """The placement request its edge sends for it, as the edge builds it."""
        rec = self.rec
        return PlacementRequest(
            job_id=self.job_id,
            edge_id=rec.edge,
            origin_zone=self.origin,
            model=rec.model,
            model_sha256=rec.sha256 if rec.sha256 and len(rec.sha256) == 64 else None,
            data_class=rec.data_class,
            payload_sha256=SHA,
            payload_bytes=rec.bytes,
            priority=rec.priority,
            deadline_at=self.deadline,
            submitted_at=self.at,
            local_estimate_ms=local_s * 1000.0,
            max_wait_ms=EDGE_MAX_WAIT_MS,
            reason="deadline" if reason == "deadline" else "queue",
        )


class SimEdge:
    """A simulated edge: its figures, its service-time estimates (the agent's own
    ``ServiceTimes``, seeded from the node's figures) and, once the replay builds it, the
    agent's own sequencer (``core``)."""

    def __init__(self, spec: EdgeSpec) -> None:
        self.spec = spec
        self.peak = 0  # most jobs held since the last telemetry interval
        self.times = ServiceTimes(0.2)
        for model, ms in spec.service_ms.items():
            self.times.seed(model, ms / 1000.0)
        self.core: Sequencer  # set by the replay (sluicegate.twin.events)
        # The agent's own defaults but for what the edge reported.
        self.limits = replace(
            DEFAULT_LIMITS,
            concurrency=spec.concurrency,
            queue_size=spec.queue_size,
            queue_bound=spec.queue_bound,
        )

    def estimate(self, model: str) -> float:
        return self.times.estimate(model) or DEFAULT_SERVICE_MS / 1000.0

    @property
    def held(self) -> int:
        """Jobs against its capacity: admitting, queued, starting or running."""
        return self.core.table.held()

    def note(self) -> None:
        self.peak = max(self.peak, self.held)


class SimWorker:
    """A simulated worker: ``name`` is how the edges name it (``<worker>@<campus>`` for a
    sister campus's, whose ``home`` it is; "" for this campus's)."""

    def __init__(self, spec: WorkerSpec, factor: float, home: str = "") -> None:
        self.spec = spec
        self.home = home
        self.name = topics.peer_worker(spec.id, home) if home else spec.id
        self.settings = PoolSettings(
            id=spec.id,
            zone=spec.zone,
            device_class=spec.device_class,
            max_batch=spec.max_batch,
            concurrency=spec.concurrency,
            queue_size=max(1, spec.capacity - spec.concurrency * spec.max_batch),
        )
        self.queue: BatchQueue[tuple[Job, int]] = BatchQueue(
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
        self.peak = 0  # most jobs held since the last telemetry interval
        self.timer: float | None = None

    @property
    def held(self) -> int:
        return len(self.queue) + sum(self.in_flight.values())

    def note(self) -> None:
        self.peak = max(self.peak, self.held)

    def telemetry(self, now: float, interval_s: float) -> WorkerTelemetry:
        """Its telemetry at ``now``, built by the worker's own builder; the interval's busy
        share starts again."""
        jobs = Counter(self.queue.depths()) + self.in_flight
        busy = min(1.0, self.busy_tick / (interval_s * self.spec.concurrency))
        self.busy_tick = 0.0
        return worker_telemetry(
            self.settings,
            Sample(busy, 0.0, float(self.spec.memory_total_mb), None, None),
            ts=now,
            queue_depth=len(self.queue),
            in_flight=sum(self.in_flight.values()),
            service=self.stats,
            results={},
            refused={},
            backlog_ms=self.stats.backlog_ms(jobs),
        )

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
