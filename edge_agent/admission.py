"""Admission: the pure decision whether an incoming MQTT message becomes an accepted job.

It checks the request against the public wire contract (response topic, user properties,
content type, size, image header) without decoding the image, and returns either a
:class:`Job` or a :class:`RequestRefusal` whose reason a person can act on. The clock and the id
source are passed in. This module must never do I/O, decode pixels or import the transport.

A job's id is the app's ``job-id`` user property when it gives one; otherwise it is derived
from the request itself (:func:`derive_job_id`), so an app that resubmits the same request
(same response topic, correlation data and image) gets the same id and the edge answers it
once. Only a request with nowhere to answer (no response topic) gets a random id.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from policies.model import Policy
from sluicegate import topics
from sluicegate.transport import Message
from sluicegate.vision.image import ImageInfo, PayloadProblem, inspect_payload
from sluicegate.vision.image import PayloadLimits as Limits

DEFAULT_PRIORITY = 5
DEFAULT_DATA_CLASS = "generic"


@dataclass(frozen=True, slots=True)
class Job:
    """An accepted job; times are unix seconds."""

    job_id: str
    model: str
    payload: bytes
    image: ImageInfo
    response_topic: str
    correlation_data: bytes | None
    priority: int
    data_class: str
    received_at: float
    deadline: float | None
    sent_at: float | None = None  # when the app sent it (its ``sent-at``), unix s


@dataclass(frozen=True, slots=True)
class RequestRefusal:
    """A request that will not run; ``response_topic`` is None when nobody can be told."""

    job_id: str
    status: Literal["rejected", "expired"]
    code: str
    reason: str
    response_topic: str | None
    correlation_data: bytes | None
    model: str | None


# More than this many user properties on a request is refused: a job needs seven at most.
MAX_USER_PROPERTIES = 32


class _Props(BaseModel):
    """The job's user properties, as strings off the wire."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str = Field(alias=topics.PROP_MODEL, min_length=1, max_length=128)
    deadline_ms: float | None = Field(None, alias=topics.PROP_DEADLINE_MS, gt=0)
    deadline_at: float | None = Field(None, alias=topics.PROP_DEADLINE_AT, gt=0)
    sent_at: float | None = Field(None, alias=topics.PROP_SENT_AT, gt=0)
    priority: int = Field(DEFAULT_PRIORITY, alias=topics.PROP_PRIORITY, ge=0, le=9)
    data_class: str = Field(
        DEFAULT_DATA_CLASS,
        alias=topics.PROP_DATA_CLASS,
        pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$",
    )
    # No ':': the broker's Redis keys put a suffix after the id (job:<id>, job:<id>:decision),
    # so job 'x:decision' and job x's decision would share a key. Workers accept 128.
    job_id: str | None = Field(
        None, alias=topics.PROP_JOB_ID, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
    )

    @field_validator("deadline_ms", "deadline_at", "sent_at")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


_ACCEPTS = {
    topics.PROP_MODEL: "a model name such as 'defect-v1'",
    topics.PROP_DEADLINE_MS: "milliseconds from receipt, a number > 0",
    topics.PROP_DEADLINE_AT: "unix time in milliseconds, a number > 0",
    topics.PROP_SENT_AT: "unix time in milliseconds, a number > 0",
    topics.PROP_PRIORITY: "an integer 0 (lowest) to 9 (highest)",
    topics.PROP_DATA_CLASS: "lower-case letters, digits, '.', '_' or '-'",
    topics.PROP_JOB_ID: (
        "1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"
    ),
}


def _explain(exc: ValidationError, raw: dict[str, str]) -> str:
    parts = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        if err["type"] == "missing":
            parts.append(f"missing user property {name!r} ({_ACCEPTS.get(name, '')})")
        else:
            parts.append(
                f"user property {name!r}={raw.get(name)!r} is invalid: "
                f"expected {_ACCEPTS.get(name, err['msg'])}"
            )
    return "; ".join(parts)


def derive_job_id(response_topic: str, correlation_data: bytes | None, payload: bytes) -> str:
    """The first 32 hex digits of sha256(response topic, NUL, correlation data, NUL, image)."""
    digest = hashlib.sha256(response_topic.encode())
    digest.update(b"\0")
    digest.update(correlation_data or b"")
    digest.update(b"\0")
    digest.update(payload)
    return digest.hexdigest()[:32]


def _job_id(msg: Message, new_id: Callable[[], str]) -> str:
    if msg.response_topic:
        return derive_job_id(msg.response_topic, msg.correlation_data, msg.payload)
    return new_id()  # nowhere to answer: the id only names it in the log


def admit(
    msg: Message,
    *,
    models: Collection[str],
    limits: Limits,
    now: float,
    new_id: Callable[[], str],
) -> Job | RequestRefusal:
    """Decide whether ``msg`` is an acceptable job; never raises for bad input."""
    raw = dict(msg.user_properties)

    def refuse(code: str, reason: str, model: str | None = None) -> RequestRefusal:
        status: Literal["rejected", "expired"] = "expired" if code == "expired" else "rejected"
        job_id = _ident(msg, raw, limits, new_id)
        return RequestRefusal(
            job_id, status, code, reason, msg.response_topic, msg.correlation_data, model
        )

    if not msg.response_topic:
        return refuse("no_response_topic", "the request has no MQTT v5 Response Topic")
    if len(msg.user_properties) > MAX_USER_PROPERTIES:
        return refuse(
            "bad_property",
            f"the request carries {len(msg.user_properties)} user properties; at most "
            f"{MAX_USER_PROPERTIES} are accepted (model, deadline-ms, deadline-at, priority, "
            "data-class, job-id, sent-at and your own)",
            raw.get(topics.PROP_MODEL),
        )
    try:
        props = _Props.model_validate(raw)
    except ValidationError as exc:
        return refuse("bad_property", _explain(exc, raw), raw.get(topics.PROP_MODEL))
    if props.model not in models:
        known = ", ".join(sorted(models)) or "none loaded"
        return refuse("unknown_model", f"unknown model {props.model!r}; known: {known}")

    def refuse_for_model(code: str, reason: str) -> RequestRefusal:
        return refuse(code, reason, props.model)

    info = _image(msg, limits)
    if isinstance(info, PayloadProblem):
        return refuse_for_model(info.code, info.reason)
    deadline = _deadline(props, now)
    if deadline is not None and deadline <= now:
        late = (now - deadline) * 1000.0
        return refuse_for_model("expired", f"the deadline passed {late:.0f} ms before receipt")
    return Job(
        job_id=_ident(msg, raw, limits, new_id),
        model=props.model,
        payload=msg.payload,
        image=info,
        response_topic=msg.response_topic,
        correlation_data=msg.correlation_data,
        priority=props.priority,
        data_class=props.data_class,
        received_at=now,
        deadline=deadline,
        sent_at=props.sent_at / 1000.0 if props.sent_at is not None else None,
    )


def _ident(msg: Message, raw: dict[str, str], limits: Limits, new_id: Callable[[], str]) -> str:
    """The job's id: the app's job-id (a malformed one is still echoed back in a refusal,
    so the sender can match it), else derived from the request, but only once its size has
    passed (never hash 8 MiB to refuse it)."""
    given = raw.get(topics.PROP_JOB_ID)
    if given:
        return given
    if len(msg.payload) <= limits.max_payload_bytes:
        return _job_id(msg, new_id)
    return new_id()


def _image(msg: Message, limits: Limits) -> ImageInfo | PayloadProblem:
    """The payload's image header, checked against the limits (never decoded here)."""
    size = len(msg.payload)
    if size == 0:
        return PayloadProblem("empty_payload", "the payload is empty; send a JPEG or PNG image")
    if size > limits.max_payload_bytes:
        return PayloadProblem(
            "payload_too_large",
            f"payload is {size} bytes; the limit is {limits.max_payload_bytes} bytes",
        )
    return inspect_payload(
        msg.payload, msg.content_type, max_pixels=limits.max_pixels, max_side=limits.max_side
    )


def _deadline(props: _Props, now: float) -> float | None:
    """The earlier of ``deadline-ms`` (from receipt) and ``deadline-at``, if either."""
    deadline = None
    if props.deadline_ms is not None:
        deadline = now + props.deadline_ms / 1000.0
    if props.deadline_at is not None:
        at = props.deadline_at / 1000.0
        deadline = at if deadline is None else min(deadline, at)
    return deadline


def _refuse_job(job: Job, code: str, reason: str) -> RequestRefusal:
    return RequestRefusal(
        job.job_id, "rejected", code, reason, job.response_topic, job.correlation_data, job.model
    )


def queue_full(job: Job, edge_id: str, queue_size: int) -> RequestRefusal:
    reason = f"edge agent {edge_id} has {queue_size} jobs queued; retry later or lower the rate"
    return _refuse_job(job, "queue_full", reason)


def outbox_unavailable(job: Job, edge_id: str, error: Exception) -> RequestRefusal:
    reason = f"edge agent {edge_id} cannot store jobs now ({error}); resubmit later"
    return _refuse_job(job, "outbox_unavailable", reason)


def forgotten(job: Job, retention_s: float) -> RequestRefusal:
    """A resubmission of a job whose result was delivered so long ago that only its id is
    left: it is not run twice."""
    reason = (
        f"job {job.job_id} already ran and its result was delivered more than "
        f"{retention_s:.0f} s ago; to run it again, give it a job-id of its own (or, without "
        "one, new correlation data)"
    )
    return _refuse_job(job, "duplicate_job", reason)


def shutting_down(msg: Message, edge_id: str, new_id: Callable[[], str]) -> RequestRefusal:
    """A request that arrives while the agent stops: not admitted, answered at once."""
    return RequestRefusal(
        msg.user_property(topics.PROP_JOB_ID) or _job_id(msg, new_id),
        "rejected",
        "shutting_down",
        f"edge agent {edge_id} is shutting down; resubmit shortly",
        msg.response_topic,
        msg.correlation_data,
        msg.user_property(topics.PROP_MODEL),
    )


def queue_key(job: Job) -> tuple[int, float]:
    """Order of the local queue: higher priority first, then earliest deadline (then FIFO)."""
    return (-job.priority, job.deadline if job.deadline is not None else math.inf)


def results_topics(policy: Policy, edge_id: str) -> tuple[str, ...]:
    """The topic filters this edge may answer on: the default response topic of each app
    the policy lets submit to it, and those apps' results prefixes. Empty when the policy
    names no app for this edge (then nothing is checked here)."""
    out: list[str] = []
    for app in policy.apps:
        if edge_id in app.edges:
            out.append(topics.client_results(app.app_id))
            out += [f"{prefix}/#" for prefix in app.results]
    return tuple(out)


def owner_of(policy: Policy | None, edge_id: str, response_topic: str) -> str:
    """The app a job is billed to: the first app (by id) the policy lets submit to this
    edge whose results topics its Response Topic falls under; "" when none does."""
    if policy is None:
        return ""
    for app in sorted(policy.apps, key=lambda a: a.app_id):
        if edge_id not in app.edges:
            continue
        filters = (topics.client_results(app.app_id), *(f"{p}/#" for p in app.results))
        if any(topics.matches(f, response_topic) for f in filters):
            return app.app_id
    return ""


class Owners:
    """:func:`owner_of` against the policy in force, remembered per Response Topic until the
    policy changes (an app answers on a handful of topics; the lookup is on every job)."""

    MAX = 4096

    def __init__(self, edge_id: str) -> None:
        self._edge_id = edge_id
        self._digest = b""
        self._known: dict[str, str] = {}

    def of(self, policy: Policy | None, response_topic: str) -> str:
        if policy is None:
            return ""
        if self._digest != policy.digest or len(self._known) >= self.MAX:
            self._digest, self._known = policy.digest, {}
        owner = self._known.get(response_topic)
        if owner is None:
            owner = self._known[response_topic] = owner_of(policy, self._edge_id, response_topic)
        return owner


class ResultsGate:
    """:func:`unanswerable` against the policy in force, its topics worked out once per
    policy version."""

    def __init__(self, edge_id: str) -> None:
        self._edge_id = edge_id
        self._allowed: tuple[bytes, tuple[str, ...]] = (b"", ())

    def check(self, job: Job, policy: Policy | None) -> RequestRefusal | None:
        if policy is None:
            return None
        if self._allowed[0] != policy.digest:
            self._allowed = (policy.digest, results_topics(policy, self._edge_id))
        return unanswerable(job, self._allowed[1], self._edge_id)


def unanswerable(job: Job, allowed: tuple[str, ...], edge_id: str) -> RequestRefusal | None:
    """A job whose Response Topic this edge may not publish to (the ACL would drop its
    result): refused before it is accepted, with nowhere to say so but the log."""
    if not allowed or any(topics.matches(f, job.response_topic) for f in allowed):
        return None
    reason = (
        f"edge {edge_id} may not answer on Response Topic {job.response_topic!r}; the policy "
        f"lets its apps take results on {', '.join(allowed)}"
    )
    return RequestRefusal(
        job.job_id, "rejected", "response_topic_not_allowed", reason, None, None, job.model
    )
