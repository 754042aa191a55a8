"""The twin's trace: what a campus did, as the records a replay needs, in one file.

A trace is gzip-compressed JSON lines (``sluicegate-trace/1``): one :class:`Header` first
(the policy and placement parameters in force, the edges and workers with what they hold
and their measured service times), then :class:`JobRecord` lines in order of arrival, with
:class:`TelemetryRecord`, :class:`NodeEvent` and :class:`AnnouncedRecord` (an edge's book of
announced work, as it published it) lines among them. JSON lines rather than
columns: a recorder appends as the campus runs, a reader streams it, a person can read it
with ``zcat | head``, and gzip brings the repetition of keys down to a few bytes a job
(a 10-minute two-line trace is well under a megabyte); Parquet would need pyarrow in the
base install for no gain at these sizes.

Times in job, telemetry and event records are seconds since the trace's start (the
header's ``started_at``, unix seconds). Reading validates every line (pydantic, extra keys
refused) and names the line of the first bad one; :func:`digest` is the sha256 of the
file's uncompressed lines, the trace's identity in a report and a verdict.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from policies.errors import PolicyError
from policies.loader import parse_canonical, parse_policy
from policies.model import Policy
from sluicegate.errors import SluicegateError
from sluicegate.wire import Announced

FORMAT: Literal["sluicegate-trace/1"] = "sluicegate-trace/1"
Status = Literal["ok", "rejected", "failed", "expired"]


class TraceError(SluicegateError):
    """A trace file cannot be read, or does not follow ``sluicegate-trace/1``."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Self:
        return self  # frozen: a copy of a replay shares its records (sluicegate.twin.oracle)


class EdgeSpec(_Record):
    """One edge agent as it was configured, and its measured compute per model (ms)."""

    id: str
    zone: str
    concurrency: int = Field(ge=1)
    queue_size: int = Field(ge=1)
    queue_bound: int = Field(ge=0)
    offload: bool = True
    service_ms: dict[str, float] = Field(default_factory=dict)  # its priors / averages


class WorkerSpec(_Record):
    """One pool worker: where it is, what it holds, how it batches, its service times."""

    id: str
    zone: str
    device_class: str
    models: dict[str, str | None]  # name -> sha256 of the file loaded (None: not reported)
    providers: list[str] = Field(default_factory=lambda: ["CPUExecutionProvider"])
    memory_total_mb: int = Field(16_384, ge=0)
    capacity: int = Field(ge=1)
    max_batch: int = Field(ge=1)
    concurrency: int = Field(ge=1)
    batch_window_ms: float = Field(2.0, ge=0.0)
    service_ms: dict[str, float] = Field(default_factory=dict)


class Header(_Record):
    """The first line: what was in force while the trace was recorded."""

    type: Literal["header"] = "header"
    format: Literal["sluicegate-trace/1"] = FORMAT
    started_at: float  # unix seconds; every other record's ``at`` counts from here
    source: Literal["live", "audit", "synthetic"]
    # The policy in force, as its canonical JSON (what the policy topic carries, and what
    # :func:`policy_field` makes of a policy file); a trace written with the TOML text
    # still reads.
    policy: str
    params: dict[str, object] = Field(default_factory=dict)  # PlacementParams.describe()
    telemetry_interval_s: float = Field(1.0, gt=0.0)
    edges: list[EdgeSpec]
    workers: list[WorkerSpec]


class JobRecord(_Record):
    """One job: its arrival as the edge saw it, then what became of it."""

    type: Literal["job"] = "job"
    at: float = Field(ge=0.0)  # arrival at the edge
    edge: str
    job_id: str
    model: str
    sha256: str | None = None
    data_class: str
    priority: int = Field(5, ge=0, le=9)
    deadline_ms: float | None = Field(None, gt=0.0)
    bytes: int = Field(ge=0)
    # The outcome (None where it was not observed: a synthetic trace holds arrivals only).
    status: Status | None = None
    ran_on: str | None = None  # the node that ran it (None: it never ran)
    offloaded: bool = False
    worker: str | None = None  # the pool worker it was last placed on, whether it returned or not
    # When that worker finished it (its completion record), ms after arrival; a job that came
    # back too late to count still has it, and the replay learns that worker's times from it.
    worker_done_ms: float | None = None
    latency_ms: float = Field(0.0, ge=0.0)  # arrival at the edge to its result leaving the edge
    # Its app's send (the request's sent-at) to its arrival at the edge (None: not stamped).
    inbound_ms: float | None = Field(None, ge=0.0)
    queue_ms: float = Field(0.0, ge=0.0)  # waiting on the node that ran it
    service_ms: float = Field(0.0, ge=0.0)  # computing there (decode, preprocess, its batch)
    # Of a run on its edge, what the agent measured as its compute (decode, preprocess,
    # inference), which its service-time estimate learns from (None: not recorded).
    device_ms: float | None = Field(None, ge=0.0)
    batch: int = Field(1, ge=1)  # jobs in the batch it ran in
    predicted_ms: float | None = None  # the edge's predicted completion here, at arrival
    accepted_ms: float | None = None  # its acceptance committed on the edge, after arrival
    # The broker's predicted completion on the worker of its last attempt, after arrival.
    pool_predicted_ms: float | None = None
    code: str | None = None  # the result's code (not ok), or the offload refusal code
    # Its wait for the broker's placement answers, all attempts (None: it never asked or
    # it was not recorded), and why the broker's answer kept it on its edge.
    placement_ms: float | None = Field(None, ge=0.0)
    offload_code: str | None = None


class TelemetryRecord(_Record):
    """A node's load as it reported it."""

    type: Literal["telemetry"] = "telemetry"
    at: float = Field(ge=0.0)
    node: str
    kind: Literal["edge", "pool"]
    queue_depth: int = Field(ge=0)
    in_flight: int = Field(ge=0)
    backlog_ms: float | None = None


class NodeEvent(_Record):
    """A node went offline or came back."""

    type: Literal["event"] = "event"
    at: float = Field(ge=0.0)
    node: str
    what: Literal["offline", "online"]


class AnnouncedRecord(_Record):
    """An edge's book of announced work, whole, as it published it (empty: cleared). Its
    windows keep their unix times, as the brokers read them."""

    type: Literal["announced"] = "announced"
    at: float = Field(ge=0.0)
    edge: str
    windows: list[Announced] = Field(default_factory=list)


Record = JobRecord | TelemetryRecord | NodeEvent | AnnouncedRecord
Line = Annotated[Header | Record, Field(discriminator="type")]
_LINE: TypeAdapter[Header | Record] = TypeAdapter(Line)


@dataclass(frozen=True)
class Trace:
    """A whole trace in memory: the header, and the records in order of time."""

    header: Header
    jobs: tuple[JobRecord, ...]
    telemetry: tuple[TelemetryRecord, ...] = ()
    events: tuple[NodeEvent, ...] = ()
    announced: tuple[AnnouncedRecord, ...] = ()

    @property
    def duration_s(self) -> float:
        ends = [j.at + j.latency_ms / 1000.0 for j in self.jobs]
        return max(ends, default=0.0)

    def lines(self) -> Iterator[str]:
        """The trace as ``sluicegate-trace/1`` lines, records merged in order of time."""
        yield self.header.model_dump_json()
        records: list[Record] = [*self.jobs, *self.telemetry, *self.events, *self.announced]
        records.sort(key=lambda r: r.at)  # stable: same-time records keep their kinds' order
        for record in records:
            # Defaults left out (most of a job's fields), its type kept: it tells the kinds apart.
            data = {"type": record.type, **record.model_dump(mode="json", exclude_defaults=True)}
            yield json.dumps(data, separators=(",", ":"))


def write(path: Path, trace: Trace) -> str:
    """Write ``trace`` to ``path`` (gzip, fixed mtime so equal traces are equal files);
    returns its :func:`digest`."""
    h = hashlib.sha256()
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        for line in trace.lines():
            data = (line + "\n").encode()
            h.update(data)
            out.write(data)
    return h.hexdigest()


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        with gzip.open(path, "rb") as f:
            yield from enumerate(f, start=1)
    except FileNotFoundError as exc:
        raise TraceError(f"{path}: no such trace file") from exc
    except (OSError, EOFError) as exc:  # not gzip, or cut short
        raise TraceError(f"{path}: not a gzip-compressed trace ({exc})") from exc


def read(path: Path) -> tuple[Trace, str]:
    """The trace in ``path`` and its digest; :class:`TraceError` naming the first bad line."""
    h = hashlib.sha256()
    header: Header | None = None
    jobs: list[JobRecord] = []
    telemetry: list[TelemetryRecord] = []
    events: list[NodeEvent] = []
    announced: list[AnnouncedRecord] = []
    for number, data in _lines(path):
        h.update(data)
        try:
            record = _LINE.validate_python(json.loads(data))
        except (ValueError, ValidationError) as exc:
            first = str(exc).splitlines()[:3]
            raise TraceError(f"{path}, line {number}: {' '.join(first)}") from exc
        if number == 1:
            if not isinstance(record, Header):
                raise TraceError(f"{path}, line 1: a trace starts with its header")
            header = record
        elif isinstance(record, Header):
            raise TraceError(f"{path}, line {number}: a second header")
        elif isinstance(record, JobRecord):
            jobs.append(record)
        elif isinstance(record, TelemetryRecord):
            telemetry.append(record)
        elif isinstance(record, AnnouncedRecord):
            announced.append(record)
        else:
            events.append(record)
    if header is None:
        raise TraceError(f"{path}: empty trace (no header)")
    check(header, jobs)
    trace = Trace(
        header,
        tuple(sorted(jobs, key=lambda j: j.at)),
        tuple(telemetry),
        tuple(events),
        tuple(announced),
    )
    return trace, h.hexdigest()


def policy_field(text: str, *, source: str) -> str:
    """The header's ``policy`` for a policy given as a file's TOML text (or already as its
    canonical JSON): its canonical JSON, the one form every trace writer uses."""
    if text.lstrip().startswith("{"):
        return text
    try:
        return parse_policy(text, source=source).canonical.decode()
    except PolicyError as exc:
        raise TraceError(f"the policy to record cannot be read: {exc}") from exc


def policy_of(header: Header) -> Policy:
    """The policy the header carries, in either of its forms."""
    text = header.policy
    try:
        if text.lstrip().startswith("{"):
            return parse_canonical(text.encode(), source="the trace's policy")
        return parse_policy(text, source="the trace's policy")
    except PolicyError as exc:
        raise TraceError(f"the trace's policy cannot be read: {exc}") from exc


def check(header: Header, jobs: Iterable[JobRecord]) -> None:
    """Every job's edge is in the header, and the nodes' ids are unique."""
    edges = {e.id for e in header.edges}
    nodes = [e.id for e in header.edges] + [w.id for w in header.workers]
    if len(set(nodes)) != len(nodes):
        raise TraceError(f"the header names a node twice: {sorted(nodes)}")
    for job in jobs:
        if job.edge not in edges:
            raise TraceError(
                f"job {job.job_id} arrived at edge {job.edge!r}, which the header does not "
                f"list (edges: {sorted(edges)})"
            )
