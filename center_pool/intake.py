"""Intake: the pure decisions on one work message, in the order that keeps images sealed.

1. :func:`read_work` takes only what the placement token is checked against (job id, token,
   size, declared data class) from the MQTT properties, and where the result must go back:
   the edge that sent it, from the topic (``.../work/<edge id>``, which the ACL lets only
   that edge write), and the attempt; no token, no job id, an ``edge-id`` property naming
   another edge, a bad attempt number or an oversized payload stop here.
2. :func:`check_token` runs ``policies.verify`` over the payload's sha256 and this worker's
   id: signature, policy version, expiry, job, payload hash, class, target and zone, and the
   origin zone, which is the sending edge's zone in the policy (an edge the policy does not
   list is refused), never the zone the message declares; for work a sister campus's edge
   sent across the bridge (``topics.peer_work``, unwrapped by the shell) it is that campus
   (``peer:<campus>``), and the policy's receive terms decide.
   (The replay check needs state, so the shell runs it next.)
   A sealed image (``topics.PROP_SEALED``) is checked without its hash: a token that binds a
   sealing key with a clear image (``seal.required``), a sealed image under a token that
   binds none (``seal.unexpected``) or a key this worker does not hold
   (``seal.key_not_held``) stop here. Only once the token and the replay check passed does
   :func:`open_work` open it (HPKE, ``policies.sealing``: this worker's key, this placement's
   info) and check the plaintext's hash (``seal.open_failed``, ``token.payload_mismatch``).
3. :func:`admit_work` reads the rest (model, deadline, priority) and probes the image
   *header* (no pixel decoding) against the limits.

Nothing here decodes an image, does I/O or reads a clock; each refusal carries a code and a
reason a person can act on, and says whether the token had passed (only then does the broker
get a completion record: before that, the job was never placed here). Results, refusals
included, go back to the owning edge (``topics.edge_returns``, or ``topics.peer_returns``
on its campus), never to the app: a refusal
whose message names no valid edge cannot be returned, only counted and audited.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from policies import PlacementClaims, Policy, payload_digest, verify
from policies.errors import SealKeyNotHeld, SealRequired, SealUnexpected, TokenRefused
from policies.evaluate import peer_origin
from policies.sealing import SEAL_OVERHEAD, SealingKey, open_sealed
from policies.tokens import check_payload
from sluicegate import topics
from sluicegate.transport import Message
from sluicegate.vision.image import ImageInfo, PayloadProblem, inspect_payload
from sluicegate.vision.image import PayloadLimits as Limits

DEFAULT_PRIORITY = 5
TOKEN_MISSING = "token.missing"
POLICY_MISSING = "policy.missing"
EDGE_MISSING = "no_edge_id"
MAX_ATTEMPT = 1000  # as in wire_pool.PlacementRequest.attempt


@dataclass(frozen=True, slots=True)
class Work:
    """A work message as received: nothing in it is trusted yet."""

    job_id: str
    token: str
    payload: bytes
    props: dict[str, str]
    edge_id: str | None  # None unless the property is a valid id: nowhere to return to
    attempt: int
    correlation_data: bytes | None
    content_type: str | None
    received_at: float
    # The sister campus the work came from (its bridge wrote the topic), "" for this one's.
    peer: str = ""

    def prop(self, name: str) -> str | None:
        return self.props.get(name)

    @property
    def sealed(self) -> bool:
        """The message says its payload is sealed to this worker's key."""
        return topics.PROP_SEALED in self.props


@dataclass(frozen=True, slots=True)
class WorkRefusal:
    """A work message that will not run; ``token_passed`` says whether it was placed here."""

    job_id: str
    status: Literal["rejected", "expired"]
    code: str
    reason: str
    edge_id: str | None  # the edge it is returned to; None: counted and audited only
    attempt: int
    correlation_data: bytes | None
    model: str | None
    token_passed: bool
    received_at: float
    peer: str = ""  # the sister campus its edge is on, "" for this one


@dataclass(frozen=True, slots=True)
class WorkItem:
    """A job whose token passed and whose header fits: ready to batch. Times: unix seconds."""

    job_id: str
    model: str
    payload: bytes
    image: ImageInfo
    edge_id: str  # the result goes back to this edge (topics.edge_returns)
    attempt: int
    correlation_data: bytes | None
    priority: int
    data_class: str
    origin_zone: str
    received_at: float
    deadline: float | None
    # What the job's usage record names: the token's nonce (hex), the app it is billed to
    # (the edge's ``owner`` property; "" when absent) and the work message's payload size.
    token_id: str = ""
    owner: str = ""
    bytes_in: int = 0
    peer: str = ""  # the sister campus its edge is on, "" for this one


def refuse(work: Work, code: str, reason: str, *, token_passed: bool = False) -> WorkRefusal:
    status: Literal["rejected", "expired"] = "expired" if code == "expired" else "rejected"
    return WorkRefusal(
        work.job_id,
        status,
        code,
        reason,
        work.edge_id,
        work.attempt,
        work.correlation_data,
        work.prop(topics.PROP_MODEL),
        token_passed,
        work.received_at,
        work.peer,
    )


def read_work(msg: Message, *, limits: Limits, now: float, worker_id: str) -> Work | WorkRefusal:
    """Step 1: what the token is checked against; never raises for bad input."""
    props: dict[str, str] = {}
    for name, value in msg.user_properties:  # the first of a repeated property counts
        props.setdefault(name, value)
    edge = topics.sender(msg.topic)
    named = props.get(topics.PROP_EDGE)
    attempt = _attempt(props.get(topics.PROP_ATTEMPT))
    work = Work(
        job_id=props.get(topics.PROP_JOB_ID, ""),
        token=props.get(topics.PROP_TOKEN, ""),
        payload=msg.payload,
        props=props,
        edge_id=edge if edge is not None and _valid_id(edge) else None,
        attempt=attempt or 1,
        correlation_data=msg.correlation_data,
        content_type=msg.content_type,
        received_at=now,
        peer=topics.peer_of(msg.topic),
    )
    if not work.token:
        return refuse(
            work,
            TOKEN_MISSING,
            f"no {topics.PROP_TOKEN!r} user property: worker {worker_id} runs only jobs the "
            "campus broker placed on it; submit to your edge agent, which asks for a placement",
        )
    if not 0 < len(work.job_id) <= 128:
        return refuse(
            work,
            "bad_property",
            f"user property {topics.PROP_JOB_ID!r}={work.job_id!r} is invalid: expected the "
            "job id the placement token was minted for (1 to 128 characters)",
        )
    if work.edge_id is None:
        return refuse(
            work,
            EDGE_MISSING,
            f"work topic {msg.topic!r} names no edge: worker {worker_id} takes work on "
            f"{topics.pool_work('<zone>', worker_id, '<edge id>')!r} and returns every result "
            "through that edge agent; submit to your edge agent, which asks for a placement",
        )
    if named is not None and named != edge:
        return refuse(
            work,
            "edge.id_mismatch",
            f"user property {topics.PROP_EDGE!r}={named!r} names another edge than the one "
            f"that sent the work ({edge!r}); an edge sends only its own jobs",
        )
    if attempt is None:
        return refuse(
            work,
            "bad_property",
            f"user property {topics.PROP_ATTEMPT!r}={props.get(topics.PROP_ATTEMPT)!r} is "
            f"invalid: expected an integer 1 to {MAX_ATTEMPT} (1 for a job's first placement)",
        )
    suite = props.get(topics.PROP_SEALED)
    if suite is not None and suite != topics.SEAL_SUITE:
        return refuse(
            work,
            "bad_property",
            f"user property {topics.PROP_SEALED!r}={suite!r} is invalid: worker {worker_id} "
            f"opens only {topics.SEAL_SUITE!r}",
        )
    image_bytes = len(msg.payload) - (SEAL_OVERHEAD if suite is not None else 0)
    if image_bytes > limits.max_payload_bytes:
        return refuse(
            work,
            "payload_too_large",
            f"payload is {image_bytes} bytes; worker {worker_id} accepts at most "
            f"{limits.max_payload_bytes} bytes",
        )
    return work


def _valid_id(value: str) -> bool:
    try:
        topics.check_id("edge id", value)
    except ValueError:
        return False
    return True


def _attempt(raw: str | None) -> int | None:
    """The attempt number of a work message: 1 when absent, None when not 1..MAX_ATTEMPT."""
    if raw is None:
        return 1
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 4) or not 1 <= int(raw) <= MAX_ATTEMPT:
        return None
    return int(raw)


def check_token(
    work: Work,
    policy: Policy,
    *,
    now: float,
    worker_id: str,
    keys: Mapping[bytes, SealingKey] | None = None,
) -> PlacementClaims | WorkRefusal:
    """Step 2: the placement token against the policy, this worker and the payload's hash
    (a sealed payload's is checked once opened); the origin is the sending edge's zone in
    the policy, or the sister campus's origin (``peer:<campus>``) for a peer's work.
    ``keys``: the sealing keys this worker holds, by key id."""
    if work.peer:  # the policy decides whether that campus may send here (verify's verdict)
        origin = peer_origin(work.peer)
    else:
        entry = policy.edge(work.edge_id) if work.edge_id is not None else None
        if entry is None:
            return refuse(
                work,
                "edge.not_in_policy",
                f"edge {work.edge_id!r} is not listed in policy {policy.campus!r} "
                f"v{policy.version}; worker {worker_id} runs work only from listed edges",
            )
        origin = entry.zone
    try:
        claims = verify(
            work.token,
            policy,
            now=now,
            job_id=work.job_id,
            payload_sha256=None if work.sealed else payload_digest(work.payload),
            worker_id=worker_id,
            origin_zone=origin,
            data_class=work.prop(topics.PROP_DATA_CLASS),
        )
        _check_sealing(work, claims, keys or {}, worker_id)
    except TokenRefused as exc:
        return refuse(work, exc.reason, f"placement token refused by worker {worker_id}: {exc}")
    return claims


def _check_sealing(
    work: Work, claims: PlacementClaims, keys: Mapping[bytes, SealingKey], worker_id: str
) -> None:
    if claims.sealed and not work.sealed:
        raise SealRequired(
            f"the token binds sealing key {claims.seal_key_id.hex()}: the image must come "
            f"sealed to it ({topics.PROP_SEALED!r}={topics.SEAL_SUITE!r}), never in the clear"
        )
    if work.sealed and not claims.sealed:
        raise SealUnexpected(
            "the image is sealed but the token binds no sealing key: nothing may open it"
        )
    if work.sealed and claims.seal_key_id not in keys:
        held = ", ".join(k.hex() for k in keys) or "none"
        raise SealKeyNotHeld(
            f"the token binds sealing key {claims.seal_key_id.hex()}, which worker "
            f"{worker_id} does not hold (it holds: {held})"
        )


def open_work(
    work: Work, claims: PlacementClaims, keys: Mapping[bytes, SealingKey], *, worker_id: str
) -> Work | WorkRefusal:
    """Step 2b, after the token and the replay check passed: a sealed payload opened with the
    key the token binds and this placement's info, and the plaintext's hash checked against
    the token's; the work comes back with the plaintext and its own content type. A clear
    payload comes back as it is (its hash was checked with the token)."""
    if not work.sealed:
        return work
    key = keys.get(claims.seal_key_id)
    try:
        if key is None:  # dropped between the token check and now
            raise SealKeyNotHeld(
                f"worker {worker_id} no longer holds sealing key {claims.seal_key_id.hex()}"
            )
        plain = open_sealed(key, work.payload, claims.seal_info())
        check_payload(claims, payload_digest(plain))
    except TokenRefused as exc:
        reason = f"sealed image refused by worker {worker_id}: {exc}"
        return refuse(work, exc.reason, reason, token_passed=True)  # it was placed here
    return replace(work, payload=plain, content_type=work.prop(topics.PROP_INNER_CONTENT_TYPE))


def _number(work: Work, name: str, accepts: str, *, least: float) -> float | WorkRefusal | None:
    raw = work.prop(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < least:
        reason = f"user property {name!r}={raw!r} is invalid: expected {accepts}"
        return refuse(work, "bad_property", reason, token_passed=True)
    return value


def admit_work(
    work: Work,
    claims: PlacementClaims,
    *,
    models: Mapping[str, str],
    limits: Limits,
    now: float,
) -> WorkItem | WorkRefusal:
    """Step 3, after the token (and replay) passed: model (``models`` maps each loaded
    model's name to its file's sha256, which must be the one the edge runs, when it says),
    deadline, priority, image header."""

    def reject(code: str, reason: str) -> WorkRefusal:
        return refuse(work, code, reason, token_passed=True)

    assert work.edge_id is not None  # read_work refused the message otherwise
    model = work.prop(topics.PROP_MODEL)
    if model is None or model not in models:
        known = ", ".join(sorted(models)) or "none loaded"
        return reject("unknown_model", f"unknown model {model!r}; known: {known}")
    wanted = work.prop(topics.PROP_MODEL_SHA256)
    if wanted is not None and wanted != models[model]:
        return reject(
            "model_version",
            f"this worker serves {model} at sha256 {models[model][:12]}…, the edge runs "
            f"{wanted[:12]}…: not run here",
        )
    priority = _number(
        work, topics.PROP_PRIORITY, "an integer 0 (lowest) to 9 (highest)", least=0.0
    )
    if isinstance(priority, WorkRefusal):
        return priority
    if priority is not None and (priority != int(priority) or priority > 9):
        return reject(
            "bad_property",
            f"user property {topics.PROP_PRIORITY!r}={work.prop(topics.PROP_PRIORITY)!r} "
            "is invalid: expected an integer 0 (lowest) to 9 (highest)",
        )
    deadline_ms = _number(
        work, topics.PROP_DEADLINE_AT, "unix time in milliseconds, > 0", least=1.0
    )
    if isinstance(deadline_ms, WorkRefusal):
        return deadline_ms
    info = inspect_payload(
        work.payload, work.content_type, max_pixels=limits.max_pixels, max_side=limits.max_side
    )
    if isinstance(info, PayloadProblem):
        return reject(info.code, info.reason)
    deadline = deadline_ms / 1000.0 if deadline_ms is not None else None
    if deadline is not None and deadline <= now:
        late = (now - deadline) * 1000.0
        return reject("expired", f"the deadline passed {late:.0f} ms before the job arrived")
    return WorkItem(
        job_id=work.job_id,
        model=model,
        payload=work.payload,
        image=info,
        edge_id=work.edge_id,
        attempt=work.attempt,
        correlation_data=work.correlation_data,
        priority=int(priority) if priority is not None else DEFAULT_PRIORITY,
        data_class=claims.data_class,
        origin_zone=claims.origin_zone,
        received_at=work.received_at,
        deadline=deadline,
        token_id=claims.nonce.hex(),
        owner=(work.prop(topics.PROP_OWNER) or "")[:64],
        bytes_in=len(work.payload),
        peer=work.peer,
    )
