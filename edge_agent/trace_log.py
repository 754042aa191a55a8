"""The records of the jobs this edge concluded, kept until its next telemetry sends them to
the digital twin's recorder (``sluicegate twin record``, ``docs/twin.md``).

One record per job, made as its result leaves the edge (or as the request is refused once it
was read as a job): when it arrived, what it asked for, where it ran and how long each part
took, from the job and its result document. The records wait in memory, at most ``limit`` of
them: past that a record is dropped and counted, so a recorder that is not listening, or a
burst, never grows the agent. The telemetry timer takes them as one ``EdgeTrace`` document.
Pure: no I/O and no clock (the caller says when the result left).
"""

from __future__ import annotations

from edge_agent.admission import Job
from sluicegate import topics, wire

MAX_RECORDS = 10_000  # records kept between two telemetry messages, at most
_RAN = ("ok", "failed")  # a worker's result with one of these statuses: the job ran there


def _ms(later: float, earlier: float) -> float:
    return round(max(0.0, (later - earlier) * 1000.0), 3)


def _inbound(job: Job) -> float | None:
    """From its app's send (its ``sent-at``) to its arrival here; None: not stamped."""
    return _ms(job.received_at, job.sent_at) if job.sent_at is not None else None


def record_of(
    job: Job,
    result: wire.JobResult,
    *,
    left_at: float,
    started: float | None,
    sha256: str | None,
    predicted: float | None,
    accepted: float | None = None,
    pool_predicted: float | None = None,
    asked_s: float | None = None,
) -> wire.TraceJob:
    """The record of ``job`` concluded with ``result``, which left the edge at ``left_at``.
    ``started``: when its run here started (None: it did not run here); ``predicted``: when
    the edge predicted at admission it would be done here (unix s); ``accepted``: when its
    acceptance was committed; ``pool_predicted``: when the broker predicted its last
    attempt would be done on the worker it was placed on; ``asked_s``: how long it waited
    for the broker's placement answers (None: it never asked)."""
    on = result.ran_on
    ran = started is not None if on.kind == "edge" else result.status in _RAN
    times = result.timings_ms
    code = result.code
    if code is None and result.offload is not None and not result.offload.placed:
        code = result.offload.code
    deadline = job.deadline
    placed = result.offload.worker if result.offload is not None and result.offload.placed else None
    node = on.node
    if on.kind == "pool" and placed is not None and topics.campus_of(placed):
        node = placed  # a sister campus's worker, named as this campus names it: w@campus
    return wire.TraceJob(
        received_at=job.received_at,
        job_id=job.job_id,
        model=job.model,
        sha256=sha256,
        data_class=job.data_class,
        priority=job.priority,
        deadline_ms=max(0.001, _ms(deadline, job.received_at)) if deadline is not None else None,
        bytes=len(job.payload),
        status=result.status,
        ran_on=node if ran else None,
        offloaded=ran and on.kind == "pool",
        worker=node if ran and on.kind == "pool" else placed,
        latency_ms=_ms(left_at, job.received_at),
        inbound_ms=_inbound(job),
        queue_ms=round(max(0.0, times.queue_ms), 3) if ran else 0.0,
        service_ms=round(max(0.0, times.total_ms - times.queue_ms), 3) if ran else 0.0,
        device_ms=round(times.device_ms, 3) if ran and on.kind == "edge" else None,
        predicted_ms=_ms(predicted, job.received_at) if predicted is not None else None,
        accepted_ms=_ms(accepted, job.received_at) if accepted is not None else None,
        pool_predicted_ms=(
            _ms(pool_predicted, job.received_at) if pool_predicted is not None else None
        ),
        code=code,
        placement_ms=round(asked_s * 1000.0, 3) if asked_s is not None else None,
        offload_code=(
            result.offload.code
            if result.offload is not None and not result.offload.placed
            else None
        ),
    )


def refusal_of(job: Job, status: wire.Status, code: str, *, now: float) -> wire.TraceJob:
    """The record of a request read as ``job`` and refused (queue full, ...) at ``now``."""
    deadline = job.deadline
    return wire.TraceJob(
        received_at=job.received_at,
        job_id=job.job_id,
        model=job.model,
        data_class=job.data_class,
        priority=job.priority,
        deadline_ms=max(0.001, _ms(deadline, job.received_at)) if deadline is not None else None,
        bytes=len(job.payload),
        status=status,
        latency_ms=_ms(now, job.received_at),
        inbound_ms=_inbound(job),
        code=code,
    )


class TraceLog:
    """The records gathered since the last telemetry, bounded."""

    def __init__(
        self, edge_id: str, *, offload: bool, queue_bound: int, limit: int = MAX_RECORDS
    ) -> None:
        self._edge_id = edge_id
        self._offload = offload
        self._queue_bound = queue_bound
        self._limit = limit
        self._records: list[wire.TraceJob] = []

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: wire.TraceJob) -> bool:
        """Keep ``record`` for the next telemetry; False when the batch is full (dropped)."""
        if len(self._records) >= self._limit:
            return False
        self._records.append(record)
        return True

    def take(self) -> wire.EdgeTrace | None:
        """The records gathered so far as one document (None: there are none), and a fresh
        batch."""
        if not self._records:
            return None
        records, self._records = self._records, []
        return wire.EdgeTrace(
            node=self._edge_id,
            records=records,
            offload=self._offload,
            queue_bound=self._queue_bound,
        )
