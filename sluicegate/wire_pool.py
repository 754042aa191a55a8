"""Wire models between the roles of the campus: edge agents, the broker and pool workers.

Placement requests carry job metadata and the image's sha256, never the image. Workers
advertise what they can run (retained capabilities) and how loaded they are (telemetry),
and report each finished job to the broker (completion records, again without outputs).
Every document carries ``v``; inside the processes these become frozen dataclasses.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sluicegate.wire import WIRE_VERSION, ModelLoad, NodeKind, Status


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Sha256Hex = str  # 64 lowercase hex digits; validated where it is used


class PlacementRequest(_Wire):
    """Edge → broker: where should this job run? (``sluicegate/v1/broker/placement/request/
    {edge_id}``, with its own correlation data; the reply goes to the edge's placement topic).
    ``edge_id`` must be the topic's; the broker takes the origin zone from the policy's entry
    for that edge and never from the message."""

    v: Literal[1] = WIRE_VERSION
    job_id: str = Field(min_length=1, max_length=128)
    edge_id: str
    # Filled in by the broker from the policy; anything an edge sends here is replaced.
    origin_zone: str = ""
    model: str
    # The sha256 of the model file the edge runs: the broker places the job only where
    # exactly that model is loaded. Without it, any version of ``model`` will do.
    model_sha256: Sha256Hex | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    data_class: str
    payload_sha256: Sha256Hex = Field(pattern=r"^[0-9a-f]{64}$")
    payload_bytes: int = Field(ge=0)
    priority: int = Field(ge=0, le=9)
    deadline_at: float | None = None  # unix seconds
    submitted_at: float  # unix seconds, when the edge accepted the job
    local_estimate_ms: float | None = None  # the edge's own predicted completion
    reason: Literal["deadline", "queue"] = "deadline"
    # How long the broker may hold the request waiting for room before it must answer:
    # the edge stops waiting after its own timeout and runs the job itself.
    max_wait_ms: float = Field(0.0, ge=0.0)
    # 1 for a job's first placement, one more each time the edge asks again for the same
    # job (its worker was lost, or no result came back in time).
    attempt: int = Field(1, ge=1, le=1000)
    # The asking campus keeps this class confidential (a sister campus's ask): the placement
    # must bind the worker's sealing key whatever this campus's policy says of the class.
    sealed: bool = False


class PlacementReply(_Wire):
    """Broker → edge: a signed placement, or a refusal that says why."""

    v: Literal[1] = WIRE_VERSION
    job_id: str
    status: Literal["placed", "refused"]
    token: str | None = None
    worker_id: str | None = None
    worker_zone: str | None = None
    work_topic: str | None = None
    predicted_ms: float | None = None
    code: str | None = None  # for refusals: policy_denied, no_capacity, no_worker, ...
    reason: str | None = None
    broker_id: str | None = None
    # A placement on a sister campus, relayed by this campus's broker: the campus whose
    # broker signed the token (None: this campus), and, when the token binds a sealing key,
    # that worker's public key (its ``policies.sealing`` text: this campus's policy does not
    # list the peer's workers, and the token binds the key's id).
    campus: str | None = Field(default=None, max_length=64)
    seal_key: str | None = Field(default=None, max_length=128)


class PlacementRelease(_Wire):
    """Edge → broker: a placement granted for ``attempt`` of ``job_id`` that the edge will not
    use (it came after the edge gave up, its token failed the edge's checks, or the job was
    concluded or proved a repeat meanwhile). Nothing was sent to ``worker_id``; the broker
    frees the slot at once instead of holding it until the reservation expires
    (``sluicegate/v1/broker/placement/release/{edge_id}``)."""

    v: Literal[1] = WIRE_VERSION
    job_id: str = Field(min_length=1, max_length=128)
    edge_id: str = Field(min_length=1, max_length=64)
    worker_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1, le=1000)
    reason: str = Field("", max_length=300)


class ModelCapability(_Wire):
    """One model a worker has loaded: its version, the sha256 of its file (the exact model:
    placement matches it against the edge's), what it needs and where it runs."""

    version: str
    sha256: Sha256Hex | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    memory_mb: int = 0
    providers: list[str] = Field(default_factory=list)  # providers the model may run on
    backend: str | None = None  # runtime and device, e.g. "onnxruntime/CPUExecutionProvider"


class WorkerCapabilities(_Wire):
    """Retained on ``sluicegate/v1/worker/{id}/capabilities``."""

    v: Literal[1] = WIRE_VERSION
    worker_id: str
    zone: str
    device_class: str  # e.g. nvidia-a100, ascend-910b, x86-cpu
    providers: list[str]  # ONNX Runtime execution providers actually available
    memory_total_mb: int
    models: dict[str, ModelCapability]
    max_batch: int = Field(ge=1)
    concurrency: int = Field(ge=1)
    # The worker's current sealing key (``x25519:...``, policies.sealing): edges seal its
    # images to it when the policy lists it for this worker. None: it holds none listed.
    seal_key: str | None = Field(default=None, max_length=64)


class WorkerTelemetry(_Wire):
    """A worker's load, every interval, on ``sluicegate/v1/worker/{id}/telemetry``."""

    v: Literal[1] = WIRE_VERSION
    node: str
    zone: str
    ts: float
    device_class: str
    utilisation: float = Field(ge=0.0, le=1.0)
    memory_used_mb: float = Field(ge=0.0)
    memory_total_mb: float = Field(ge=0.0)
    memory_bandwidth: float | None = Field(default=None, ge=0.0, le=1.0)
    temperature_c: float | None = None
    queue_depth: int = Field(ge=0)
    in_flight: int = Field(ge=0)
    capacity: int = Field(ge=1)  # jobs it can hold (running + queued) before it is full
    # The work it holds, ms: each queued and running job at its own model's service time.
    backlog_ms: float | None = Field(default=None, ge=0.0)
    models: dict[str, ModelLoad]
    results: dict[str, int]
    refused: dict[str, int]  # work messages refused before decoding, by reason code


class Completion(_Wire):
    """Worker → broker after each job (``sluicegate/v1/broker/completions/{worker_id}``)."""

    v: Literal[1] = WIRE_VERSION
    job_id: str
    worker_id: str
    kind: NodeKind = "pool"
    status: Status
    model: str
    service_ms: float
    queue_ms: float
    batch_size: int = Field(ge=1)
    ts: float
    attempt: int = Field(1, ge=1, le=1000)
    edge_id: str | None = None


class JobNotice(_Wire):
    """Broker → edge on ``sluicegate/v1/edge/{id}/notices``: what happened to a placed job.

    ``worker_lost``: the worker holding ``attempt`` died; place the job again (or run it
    locally) as the next attempt. ``dead_letter``: the job has now been on ``crashes``
    workers that died with it; stop retrying and answer the app ``failed`` with ``reason``.
    ``released``: an operator released the dead letter for one retry: run its image again
    as a new job, ``retry_id``, answered like the original (``reason``: who, and why).
    """

    v: Literal[1] = WIRE_VERSION
    job_id: str
    attempt: int = Field(ge=1)
    kind: Literal["worker_lost", "dead_letter", "released"]
    worker_id: str
    crashes: int = Field(ge=0)
    reason: str
    retry_id: str | None = Field(None, min_length=1, max_length=200)  # with "released"


MAX_JOB_ID = 128  # the edge's admission accepts ids of 1 to 128 of [A-Za-z0-9._-]


def retry_id(job_id: str) -> str:
    """The job id of a released dead letter's retry: ``<job id>.retry``, shortened (with a
    digest of the whole id) when that would pass :data:`MAX_JOB_ID`."""
    tail = ".retry"
    if len(job_id) + len(tail) <= MAX_JOB_ID:
        return job_id + tail
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:8]
    return f"{job_id[: MAX_JOB_ID - len(tail) - 9]}-{digest}{tail}"
