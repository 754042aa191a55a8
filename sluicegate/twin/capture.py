"""What a recording heard, turned into a trace: the documents a campus publishes (the edges'
job records and telemetry, the workers' capabilities, telemetry, status and completions, the
retained policy) in, one :class:`~sluicegate.twin.trace.Trace` out.

:class:`Capture` is fed one message at a time (its topic, its bytes, when it arrived) and
never does I/O or reads a clock: the recorder (``sluicegate.twin.record``) is the shell that
feeds it. Who spoke is read from the topic, as everywhere in Sluicegate; a document that
names another node, does not parse, or is of a version this code does not know is refused
with a message naming the topic and the problem, and counted, and the recording goes on.

What goes into the trace: the jobs that arrived while it recorded (one record per edge and
job id, the first heard), each joined with its worker's completion for the size of the
batch it ran in; every telemetry message heard in that time; the nodes going offline and
coming back. The header lists the edges whose telemetry was heard and the workers whose
capabilities and telemetry were, with their last reported figures. A job from an edge the
header cannot list is left out, and counted.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from broker.core.params import PlacementParams
from policies.errors import PolicyError
from policies.signing import open_envelope
from sluicegate import topics, wire
from sluicegate.twin import trace as tr
from sluicegate.wire_pool import Completion, WorkerCapabilities, WorkerTelemetry

M = TypeVar("M", bound=BaseModel)
QUEUE_BOUND = 32  # an edge's [offload] queue_bound when its records do not say
NOTES_KEPT = 20  # refusals remembered word for word (all are counted)


class CaptureError(tr.TraceError):
    """What was heard cannot make a trace (no policy arrived, no edge was heard)."""


@dataclass
class _Edge:
    telemetry: wire.EdgeTelemetry | None = None
    # Its models' figures in the first telemetry heard: what it believed when recording began
    opening: Mapping[str, wire.ModelLoad] | None = None
    offload: bool | None = None
    queue_bound: int | None = None
    intervals: list[float] = field(default_factory=list)
    heard_at: float | None = None  # when its latest telemetry arrived


@dataclass
class _Worker:
    capabilities: WorkerCapabilities | None = None
    telemetry: WorkerTelemetry | None = None
    opening: Mapping[str, wire.ModelLoad] | None = None  # as for an edge


class Capture:
    """The trace being built from the documents heard since ``started_at`` (unix s)."""

    def __init__(
        self,
        started_at: float,
        *,
        params: Mapping[str, object] | None = None,
        telemetry_interval_s: float | None = None,
        policy_text: str | None = None,
    ) -> None:
        """``params``: the placement parameters in force (default: the broker's defaults);
        ``telemetry_interval_s``: the nodes' cadence (default: measured from the edges'
        telemetry); ``policy_text``: the policy to record if none arrives on the topic."""
        self.started_at = started_at
        self.ended_at: float | None = None
        given = params if params is not None else PlacementParams().describe()
        self._params = json.loads(json.dumps(dict(given)))  # as a trace file holds them
        self._interval = telemetry_interval_s
        self._policy: str | None = None
        fallback = policy_text
        if fallback is not None:
            fallback = tr.policy_field(fallback, source="the policy file given")
        self._policy_fallback = fallback
        self._edges: dict[str, _Edge] = {}
        self._workers: dict[str, _Worker] = {}
        self._jobs: dict[tuple[str, str], wire.TraceJob] = {}
        self._completions: dict[tuple[str, str], Completion] = {}  # (job id, worker) -> it
        self._telemetry: list[tr.TelemetryRecord] = []
        self._events: list[tr.NodeEvent] = []
        self._announced: list[tr.AnnouncedRecord] = []
        self._state: dict[str, str] = {}  # node -> online / offline, as last heard
        self.left_out: Counter[str] = Counter()  # records not in the trace, by why
        self.refused: Counter[str] = Counter()  # documents refused, by kind
        self.notes: list[str] = []  # the first refusals, in words
        self.unbatched = 0  # offloaded jobs whose completion was not heard (batch taken as 1)
        self._routes: list[tuple[str, Callable[[str, bytes, float, bool], None]]] = [
            (topics.edge_trace_all(), self._edge_trace),
            (topics.edge_telemetry_all(), self._edge_telemetry),
            (topics.edge_status_all(), self._status),
            (topics.worker_all("capabilities"), self._capabilities),
            (topics.worker_all("telemetry"), self._worker_telemetry),
            (topics.worker_all("status"), self._status),
            (topics.completions_all(), self._completion),
            (topics.policy(), self._policy_message),
            (topics.edge_announced_all(), self._announced_book),
        ]

    def filters(self) -> list[str]:
        """The topic filters whose messages :meth:`offer` takes."""
        return [topic_filter for topic_filter, _take in self._routes]

    # -- what comes in -------------------------------------------------------------------------

    def offer(
        self, topic: str, payload: bytes, *, now: float, retained: bool = False
    ) -> str | None:
        """Take one message heard at ``now``; returns why it was refused (None: taken)."""
        for topic_filter, take in self._routes:
            if topics.matches(topic_filter, topic):
                try:
                    take(topic, payload, now, retained)
                except _Refused as exc:
                    return self._refuse(exc.kind, f"{topic}: {exc}")
                return None
        return self._refuse("topic", f"{topic}: not a topic the recorder reads")

    def stop(self, now: float) -> None:
        """Recording ends at ``now``: jobs that arrive later are left out (what is heard
        from here on still completes the jobs before)."""
        if self.ended_at is None:
            self.ended_at = now

    def _refuse(self, kind: str, why: str) -> str:
        self.refused[kind] += 1
        if len(self.notes) < NOTES_KEPT:
            self.notes.append(why)
        return why

    def _in_window(self, at: float) -> bool:
        return at >= self.started_at and (self.ended_at is None or at <= self.ended_at)

    def _edge_trace(self, topic: str, payload: bytes, now: float, retained: bool) -> None:
        doc = _read(wire.EdgeTrace, payload, "edge_trace")
        edge = _own(doc.node, topic, "edge_trace")
        state = self._edges.setdefault(edge, _Edge())
        if doc.offload is not None:
            state.offload = doc.offload
        if doc.queue_bound is not None:
            state.queue_bound = doc.queue_bound
        for record in doc.records:
            key = (edge, record.job_id)
            if record.received_at < self.started_at:
                self.left_out["before_start"] += 1
            elif self.ended_at is not None and record.received_at > self.ended_at:
                self.left_out["after_end"] += 1
            elif key in self._jobs:
                self.left_out["repeated"] += 1
            else:
                self._jobs[key] = record

    def _edge_telemetry(self, topic: str, payload: bytes, now: float, retained: bool) -> None:
        doc = _read(wire.EdgeTelemetry, payload, "edge_telemetry")
        edge = _own(doc.node, topic, "edge_telemetry")
        state = self._edges.setdefault(edge, _Edge())
        if state.telemetry is not None and doc.ts > state.telemetry.ts:
            state.intervals.append(doc.ts - state.telemetry.ts)
        state.telemetry, state.heard_at = doc, now
        if state.opening is None:
            state.opening = doc.models
        if self._in_window(doc.ts):
            self._telemetry.append(
                tr.TelemetryRecord(
                    at=doc.ts - self.started_at,
                    node=edge,
                    kind="edge",
                    queue_depth=doc.queue_depth,
                    in_flight=doc.in_flight,
                )
            )

    def _capabilities(self, topic: str, payload: bytes, now: float, retained: bool) -> None:
        doc = _read(WorkerCapabilities, payload, "capabilities")
        worker = _own(doc.worker_id, topic, "capabilities")
        self._workers.setdefault(worker, _Worker()).capabilities = doc

    def _worker_telemetry(self, topic: str, payload: bytes, now: float, retained: bool) -> None:
        doc = _read(WorkerTelemetry, payload, "worker_telemetry")
        worker = _own(doc.node, topic, "worker_telemetry")
        state = self._workers.setdefault(worker, _Worker())
        state.telemetry = doc
        if state.opening is None:
            state.opening = doc.models
        if self._in_window(doc.ts):
            self._telemetry.append(
                tr.TelemetryRecord(
                    at=doc.ts - self.started_at,
                    node=worker,
                    kind="pool",
                    queue_depth=doc.queue_depth,
                    in_flight=doc.in_flight,
                    backlog_ms=doc.backlog_ms,
                )
            )

    def _status(self, topic: str, payload: bytes, now: float, retained: bool) -> None:
        doc = _read(wire.NodeStatus, payload, "status")
        node = _own(doc.node, topic, "status")
        before = self._state.get(node)
        self._state[node] = doc.state
        # A retained status is how the node stood when recording began, not a change in it.
        if not retained and before != doc.state and self._in_window(now):
            self._events.append(tr.NodeEvent(at=now - self.started_at, node=node, what=doc.state))

    def _announced_book(self, topic: str, payload: bytes, now: float, retained: bool) -> None:
        # A retained book is the work announced when recording began: it counts from there.
        edge = topics.node_of(topic)
        windows: list[wire.Announced] = []
        if payload:
            doc = _read(wire.EdgeSchedule, payload, "announced")
            edge, windows = _own(doc.node, topic, "announced"), doc.windows
        if self._in_window(now):
            at = max(0.0, round(now - self.started_at, 3))
            self._announced.append(tr.AnnouncedRecord(at=at, edge=edge, windows=windows))

    def _completion(self, topic: str, payload: bytes, now: float, retained: bool) -> None:
        doc = _read(Completion, payload, "completion")
        worker = topics.sender(topic)
        if doc.worker_id != worker:
            raise _Refused("completion", f"the document names worker {doc.worker_id!r}")
        self._completions[(doc.job_id, worker)] = doc

    def _policy_message(self, topic: str, payload: bytes, now: float, retained: bool) -> None:
        try:
            policy, _anchor = open_envelope(payload, now=now, anchor=None, source=topic)
        except PolicyError as exc:
            raise _Refused("policy", f"not a signed policy this recorder accepts: {exc}") from exc
        text = policy.canonical.decode()
        if self._policy is None:
            self._policy = text
        elif text != self._policy:
            self.left_out["policy_changed"] += 1  # the trace keeps the one in force first

    # -- the trace ---------------------------------------------------------------------------

    def interval_s(self) -> float | None:
        """The telemetry interval: as given, else the median gap between an edge's
        telemetry messages (None: not heard twice yet)."""
        if self._interval is not None:
            return self._interval
        gaps = [gap for edge in self._edges.values() for gap in edge.intervals]
        return round(statistics.median(gaps), 3) if gaps else None

    def caught_up(self) -> bool:
        """Recording has ended and every edge heard has sent its telemetry since: an edge
        sends its records first, so those of the jobs it concluded before are in."""
        end = self.ended_at
        return end is not None and all(
            e.heard_at is None or e.heard_at > end for e in self._edges.values()
        )

    @property
    def jobs_heard(self) -> int:
        return len(self._jobs)

    def edge_dropped(self) -> int:
        """Records the edges dropped themselves (their batch was full), as last reported."""
        return sum(
            e.telemetry.events.get("trace_dropped", 0)
            for e in self._edges.values()
            if e.telemetry is not None
        )

    def trace(self) -> tr.Trace:
        """Everything heard so far, as a trace; :class:`CaptureError` if it cannot be one."""
        policy = self._policy or self._policy_fallback
        if policy is None:
            raise CaptureError(
                f"no signed policy arrived on {topics.policy()} (is the broker up, and may "
                "this identity read it?); give the policy file to record it instead"
            )
        edges = self._edge_specs()
        if not edges:
            raise CaptureError(
                f"no edge telemetry was heard on {topics.edge_telemetry_all()}: nothing to "
                "trace (may this identity read it? does any edge run?)"
            )
        header = tr.Header(
            started_at=self.started_at,
            source="live",
            policy=policy,
            params=self._params,
            telemetry_interval_s=self.interval_s() or 1.0,
            edges=edges,
            workers=self._worker_specs(),
        )
        listed = {e.id for e in edges}
        self.unbatched = 0
        jobs, unlisted, unreadable = [], 0, 0
        for (edge, _job_id), record in self._jobs.items():
            job = self._job(edge, record) if edge in listed else None
            unlisted += edge not in listed
            unreadable += edge in listed and job is None
            if job is not None:
                jobs.append(job)
        # Set, not added: each call counts what it left out of the trace it returns.
        self.left_out["unknown_edge"], self.left_out["unreadable"] = unlisted, unreadable
        jobs.sort(key=lambda j: j.at)
        return tr.Trace(
            header, tuple(jobs), tuple(self._telemetry), tuple(self._events), tuple(self._announced)
        )

    def _job(self, edge: str, rec: wire.TraceJob) -> tr.JobRecord | None:
        worker = rec.worker or (rec.ran_on if rec.offloaded else None)
        done = self._completions.get((rec.job_id, worker)) if worker else None
        self.unbatched += rec.offloaded and done is None
        queue_ms, service_ms = rec.queue_ms, rec.service_ms
        if done is not None and not rec.offloaded and done.status == "ok":
            # Placed, run, but back too late to count: the worker's own figures.
            queue_ms, service_ms = done.queue_ms, done.service_ms
        try:
            return tr.JobRecord(
                at=round(rec.received_at - self.started_at, 6),
                edge=edge,
                job_id=rec.job_id,
                model=rec.model,
                sha256=rec.sha256,
                data_class=rec.data_class,
                priority=rec.priority,
                deadline_ms=rec.deadline_ms,
                bytes=rec.bytes,
                status=rec.status,
                ran_on=rec.ran_on,
                offloaded=rec.offloaded,
                worker=worker,
                worker_done_ms=(
                    round(max(0.0, (done.ts - rec.received_at) * 1000.0), 3)
                    if done is not None
                    else None
                ),
                latency_ms=rec.latency_ms,
                inbound_ms=rec.inbound_ms,
                queue_ms=queue_ms,
                service_ms=service_ms,
                device_ms=rec.device_ms,
                batch=done.batch_size if done is not None else 1,
                predicted_ms=rec.predicted_ms,
                accepted_ms=rec.accepted_ms,
                pool_predicted_ms=rec.pool_predicted_ms,
                code=rec.code,
                placement_ms=rec.placement_ms,
                offload_code=rec.offload_code,
            )
        except ValidationError:
            return None

    def _edge_specs(self) -> list[tr.EdgeSpec]:
        return [
            edge_spec(
                edge.telemetry,
                queue_bound=edge.queue_bound,
                offload=edge.offload,
                opening=edge.opening,
            )
            for _, edge in sorted(self._edges.items())
            if edge.telemetry is not None
        ]

    def _worker_specs(self) -> list[tr.WorkerSpec]:
        return [
            worker_spec(worker.capabilities, worker.telemetry, opening=worker.opening)
            for _, worker in sorted(self._workers.items())
            if worker.capabilities is not None and worker.telemetry is not None
        ]  # a worker not heard serving while recording is left out


def edge_spec(
    t: wire.EdgeTelemetry,
    *,
    queue_bound: int | None = None,
    offload: bool | None = None,
    opening: Mapping[str, wire.ModelLoad] | None = None,
) -> tr.EdgeSpec:
    """An edge as a trace's header lists it, from its telemetry (and, where known, its
    queue bound and whether it offloads, which its job records say). Its service times are
    those of ``opening``, the first telemetry heard, where given: a replay starts from what
    the edge believed when the recording began and learns the rest from the jobs' runs, as
    the edge did; the latest figures already hold what the whole recording taught it."""
    return tr.EdgeSpec(
        id=t.node,
        zone=t.zone,
        concurrency=t.concurrency,
        queue_size=t.queue_capacity,
        queue_bound=QUEUE_BOUND if queue_bound is None else queue_bound,
        offload=True if offload is None else offload,
        service_ms=_service(t.models if opening is None else opening),
    )


def worker_spec(
    caps: WorkerCapabilities,
    t: WorkerTelemetry,
    *,
    opening: Mapping[str, wire.ModelLoad] | None = None,
) -> tr.WorkerSpec:
    """A pool worker as a trace's header lists it, from its capabilities and telemetry;
    its service times those of ``opening`` where given, as for an edge."""
    return tr.WorkerSpec(
        id=caps.worker_id,
        zone=caps.zone,
        device_class=caps.device_class,
        models={name: m.sha256 for name, m in sorted(caps.models.items())},
        providers=list(caps.providers),
        memory_total_mb=caps.memory_total_mb,
        capacity=t.capacity,
        max_batch=caps.max_batch,
        concurrency=caps.concurrency,
        service_ms=_service(t.models if opening is None else opening),
    )


class _Refused(Exception):
    """A document the capture does not take (internal: :meth:`Capture.offer` counts it)."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


def _read(model: type[M], payload: bytes, kind: str) -> M:
    try:
        return model.model_validate_json(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        raise _Refused(
            kind,
            f"not a {model.__name__} document ({exc.error_count()} error(s); first: "
            f"{where}: {first['msg']})",
        ) from exc


def _own(named: str, topic: str, kind: str) -> str:
    node = topics.node_of(topic)
    if named != node:
        raise _Refused(kind, f"the document names node {named!r}, but only {node!r} writes here")
    return node


def _service(models: Mapping[str, wire.ModelLoad]) -> dict[str, float]:
    return {name: m.service_ms for name, m in sorted(models.items()) if m.service_ms > 0}
