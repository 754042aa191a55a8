"""Wire models: the JSON documents Sluicegate publishes, validated with pydantic v2.

These are the public contract with vision apps (``JobResult``) and between roles
(``EdgeTelemetry``, ``EdgeTrace``, ``NodeStatus``). Each carries ``v`` so a reader can refuse
a version it does not know. Inside the processes, typed dataclasses are used; conversion
to and from bytes happens only here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from sluicegate.errors import SluicegateError
from sluicegate.instance import this_process

if TYPE_CHECKING:
    from sluicegate.vision.postprocess import Outputs as VisionOutputs

WIRE_VERSION: Literal[1] = 1
RESULT_CONTENT_TYPE = "application/json"

Status = Literal["ok", "rejected", "failed", "expired"]
NodeKind = Literal["edge", "pool"]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RanOn(_Wire):
    """Where a job was (or would have been) executed."""

    kind: NodeKind
    node: str
    zone: str


class Timings(_Wire):
    """Milliseconds spent in each stage; ``total_ms`` spans receipt to result."""

    queue_ms: float = 0.0
    decode_ms: float = 0.0
    preprocess_ms: float = 0.0
    inference_ms: float = 0.0
    total_ms: float = 0.0
    # The job's own time on the device: its decode and preprocess plus its share of its
    # batch's inference (the batch's time over its size). What a usage record bills.
    device_ms: float = 0.0
    # A job its edge concluded after asking the broker: the part of its queue_ms spent
    # waiting for the broker's placement answers (all attempts), and, when it was placed,
    # the part its work was out on workers (sent until returned unrun, lost or expired).
    # Absent otherwise, and from a worker's result, which the edge forwards as it came.
    placement_ms: float | None = None
    offloaded_ms: float | None = None


class Detection(_Wire):
    label: str
    score: float
    box: tuple[float, float, float, float]  # x1, y1, x2, y2 as fractions of the image


class Region(_Wire):
    """An anomalous area: its box (x1, y1, x2, y2, fractions of the image), its area (a
    fraction of the image's) and its highest pixel score."""

    score: float
    box: tuple[float, float, float, float]
    area: float


class TextLine(_Wire):
    """A line of text an OCR model read: the text, the recogniser's confidence, its box
    (x1, y1, x2, y2) and its four corners (top-left first, clockwise), as fractions of the
    image."""

    text: str
    score: float
    box: tuple[float, float, float, float]
    quad: list[tuple[float, float]]


class Outputs(_Wire):
    """A model's answer: the top label and every label's score (and boxes for detectors,
    regions for anomaly models, text lines for OCR models)."""

    label: str | None = None  # none: a detector that found nothing (absent from the JSON)
    scores: dict[str, float]
    detections: list[Detection] = Field(default_factory=list)
    regions: list[Region] = Field(default_factory=list)
    texts: list[TextLine] = Field(default_factory=list)
    model_version: str | None = None  # the build of the model that answered
    model_sha256: str | None = None  # the sha256 of its file


class Offload(_Wire):
    """Whether the edge asked the campus broker to move the job, and what came of it."""

    requested: bool
    placed: bool
    worker: str | None = None
    code: str | None = None  # why it was not offloaded: policy_denied, broker_unreachable, ...
    reason: str | None = None


class JobResult(_Wire):
    """The document a vision app receives on its response topic."""

    v: Literal[1] = WIRE_VERSION
    job_id: str
    status: Status
    code: str | None = None
    reason: str | None = None
    model: str | None = None
    outputs: Outputs | None = None
    ran_on: RanOn
    timings_ms: Timings = Timings()
    offload: Offload | None = None

    def raise_for_status(self) -> JobResult:
        """Return self if the job ran, else raise JobFailed with the reason."""
        if self.status != "ok":
            raise JobFailed(self)
        return self


class JobFailed(SluicegateError):
    """A job ended in a status other than ``ok``."""

    def __init__(self, result: JobResult) -> None:
        super().__init__(f"job {result.job_id} {result.status}: {result.reason}")
        self.result = result


class ModelLoad(_Wire):
    """Per-model figures in telemetry."""

    service_ms: float  # moving average of decode + preprocess + inference
    completed: int


class PredictionError(_Wire):
    """How far the edge's completion predictions were from what happened, over its last
    jobs that ran here: absolute error p50/p90 and the mean signed error (> 0: late)."""

    n: int
    p50_ms: float
    p90_ms: float
    bias_ms: float


class Announcement(_Wire):
    """App -> edge (``topics.edge_schedule``): work to come on this line, from ``starts_at``
    to ``ends_at`` (unix seconds), ``rate_per_s`` images a second in all, for ``model`` and
    of ``data_class`` (as the jobs will say). The same id again replaces it; ``withdraw``
    takes it back. The edge answers on the message's Response Topic
    (:class:`AnnouncementReply`)."""

    v: Literal[1] = WIRE_VERSION
    announcement_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    starts_at: float = Field(gt=0.0, allow_inf_nan=False)
    ends_at: float = Field(gt=0.0, allow_inf_nan=False)
    rate_per_s: float = Field(gt=0.0, le=100_000.0, allow_inf_nan=False)
    model: str = Field(min_length=1, max_length=128)
    data_class: str = Field("generic", pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")
    reason: str = Field("", max_length=200)  # shown to people: "recipe 42 at 2x", ...
    withdraw: bool = False


class AnnouncementReply(_Wire):
    """Edge -> app: what became of an announcement (``code`` and ``reason`` when refused)."""

    v: Literal[1] = WIRE_VERSION
    announcement_id: str | None
    status: Literal["accepted", "withdrawn", "refused"]
    code: str | None = None
    reason: str | None = None


class Announced(_Wire):
    """One accepted announcement as its edge reports it, with the images a second the edge
    expects to run of it itself (its compute slots over its service time for the model,
    shared with the windows that overlap it when together they ask for more:
    ``sluicegate.schedule.local_rates``)."""

    announcement_id: str
    starts_at: float
    ends_at: float
    rate_per_s: float
    model: str
    data_class: str
    local_per_s: float
    reason: str = ""


class EdgeSchedule(_Wire):
    """Edge -> brokers and observers (``topics.edge_announced``, retained): its accepted
    announcements still ahead or under way, whole, replaced on every change."""

    v: Literal[1] = WIRE_VERSION
    node: str
    zone: str
    ts: float
    windows: list[Announced] = Field(max_length=64)  # an edge keeps 16 (sluicegate.schedule)


class EdgeTelemetry(_Wire):
    """What an edge agent reports every interval."""

    v: Literal[1] = WIRE_VERSION
    node: str
    zone: str
    ts: float  # unix seconds
    queue_depth: int
    queue_capacity: int
    in_flight: int
    concurrency: int
    models: dict[str, ModelLoad]
    cpu_percent: float
    memory_rss_mb: float
    memory_percent: float
    results: dict[str, int]  # count by status since start
    dropped_no_response_topic: int
    offloaded: int = 0  # sent to a pool worker since start
    # Jobs answered ok since start, by where they ran: "edge" (here) or "pool" (a worker).
    finished: dict[str, int] = Field(default_factory=dict)
    offload_pending: int = 0  # waiting for the broker's answer now
    # Durability events since start: accepted, duplicates, redelivered, replayed,
    # republished, fenced_returns, late_results, dead_letters, outbox_errors, ...
    events: dict[str, int] = Field(default_factory=dict)
    # The verified policy version this edge holds, and the policies it refused by reason
    # (policy.unknown_signer, policy.rollback, ...): a forged retained policy shows here.
    policy_version: int | None = None
    policy_refused: dict[str, int] = Field(default_factory=dict)
    prediction: PredictionError | None = None


class TraceJob(_Wire):
    """One job an edge concluded, as the digital twin's trace needs it (``JobRecord``):
    its arrival, what was asked, and what became of it. Times are unix seconds, durations
    ms after arrival."""

    received_at: float
    job_id: str
    model: str
    sha256: str | None = None  # of the model file this edge runs under that name
    data_class: str
    priority: int
    deadline_ms: float | None = None  # after arrival; None: no deadline
    bytes: int
    status: Status
    ran_on: str | None = None  # the node that ran it; None: it never ran
    offloaded: bool = False  # ran on a pool worker
    worker: str | None = None  # the pool worker it was last placed on (returned or not)
    latency_ms: float  # arrival to the result leaving this edge
    inbound_ms: float | None = None  # the app's send (its sent-at) to arrival; None: unstamped
    queue_ms: float = 0.0  # waiting on the node that ran it
    service_ms: float = 0.0  # computing there
    device_ms: float | None = None  # of a run here: decode, preprocess and inference
    predicted_ms: float | None = None  # the edge's predicted completion here, at admission
    accepted_ms: float | None = None  # its acceptance committed, after arrival
    pool_predicted_ms: float | None = None  # the broker's predicted completion on its worker
    code: str | None = None  # the result's code, or why it was not offloaded
    # Its time waiting for the broker's placement answers, all attempts (None: it never
    # asked), and why the broker's answer kept it here, whatever its status.
    placement_ms: float | None = None
    offload_code: str | None = None


class EdgeTrace(_Wire):
    """What an edge publishes with its telemetry when it concluded jobs since the last one
    (``sluicegate/v1/edge/{id}/trace``), with the offload settings its telemetry does not
    carry (a replay decides with them)."""

    v: Literal[1] = WIRE_VERSION
    node: str
    records: list[TraceJob]
    offload: bool | None = None  # it may offer jobs to the broker
    queue_bound: int | None = None  # [offload] queue_bound: waiting jobs before it offers


class NodeStatus(_Wire):
    """Retained online/offline status; the offline copy is the Last Will. ``instance``,
    ``since`` and ``host`` name the process (``sluicegate.identity``): two processes with
    one identity see each other here."""

    v: Literal[1] = WIRE_VERSION
    node: str
    kind: Literal["edge", "pool", "broker"]
    zone: str
    state: Literal["online", "offline"]
    instance: str | None = Field(None, max_length=64)
    since: float | None = None  # unix s, when the process started
    host: str | None = Field(None, max_length=255)


def node_status(
    node: str,
    kind: Literal["edge", "pool", "broker"],
    zone: str,
    state: Literal["online", "offline"],
) -> NodeStatus:
    """This process's status as ``node``."""
    me = this_process()
    return NodeStatus(
        node=node, kind=kind, zone=zone, state=state, instance=me.id, since=me.since, host=me.host
    )


def outputs_of(outputs: VisionOutputs) -> Outputs:
    """A model's postprocessed answer as the result document carries it."""
    return Outputs(
        label=outputs.label,
        scores=outputs.scores,
        detections=[Detection(label=d.label, score=d.score, box=d.box) for d in outputs.detections],
        regions=[Region(score=r.score, box=r.box, area=r.area) for r in outputs.regions],
        texts=[
            TextLine(text=t.text, score=t.score, box=t.box, quad=list(t.quad))
            for t in outputs.texts
        ],
        model_version=outputs.version,
        model_sha256=outputs.sha256,
    )


def dump(model: BaseModel) -> bytes:
    """Serialise a wire model to compact JSON bytes."""
    return model.__pydantic_serializer__.to_json(model, exclude_none=True)
