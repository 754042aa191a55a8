"""Shared by the pool worker tests: the test policy, tokens minted with the published test
broker key, and work messages built the way an edge agent sends them: on the worker's work
topic under the sending edge's id (``topics.pool_work(zone, worker, spec.edge)``); results
come back on that edge's returns topic under the worker's id
(``topics.edge_returns(spec.edge, worker)``)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies import Policy, TrustAnchor, mint, payload_digest, signed_envelope
from policies.signing import dump_anchor, dump_signatures
from sluicegate import topics
from sluicegate.policy_feed import ANCHOR_FILE
from sluicegate.transport import Message
from tests.image_bytes import sample_jpeg
from tests.policies.policy_testkit import base_doc, key, policy_of, signed, to_toml

WORKER = "north-gpu-1"
WORKER_ZONE = "campus/fab-north/dc"
OTHER_WORKER = "south-npu-1"
ORIGIN = "campus/fab-north/line-1"
EDGE = "north-l1-pc"
DATA_CLASS = "wafer-image"
BROKER = key("broker-1")
OFFICERS = ("officer-alice", "officer-bob")
# Edges the test policy lists besides the testkit's one, all in ORIGIN: a real-tier test
# that shares a worker with others can send as an edge of its own.
SPARE_EDGES = tuple(f"north-l1-spare-{i}" for i in range(8))


def policy_doc(version: int = 1) -> dict[str, Any]:
    """The testkit's two-fab policy, with :data:`SPARE_EDGES` listed (each with its
    published test key)."""
    doc = base_doc(version=version)
    for edge in SPARE_EDGES:
        doc["edges"][edge] = {"zone": ORIGIN, "key": key(edge).public_text}
    return doc


POLICY = policy_of(policy_doc(1))
JPEG, TRUTH = sample_jpeg(21)


def envelope(policy: Policy = POLICY) -> bytes:
    return signed_envelope(policy, signed(policy, *OFFICERS))


def pin(state_dir: Path, policy: Policy = POLICY) -> Path:
    """What enrollment leaves in a node's ``state_dir``: the campus policy's trust anchor,
    pinned, and no policy yet (that comes on the retained policy topic)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / ANCHOR_FILE).write_bytes(dump_anchor(TrustAnchor.of(policy)))
    return state_dir


def write_policy_file(folder: Path, version: int = 1) -> Path:
    """A signed policy file with its ``.sig`` beside it, as an operator installs one."""
    doc = policy_doc(version)
    path = folder / f"policy-v{version}.toml"
    path.write_text(to_toml(doc), encoding="utf-8")
    sig = dump_signatures(signed(policy_of(doc), *OFFICERS))
    path.with_name(path.name + ".sig").write_bytes(sig)
    return path


def token(
    job_id: str,
    payload: bytes,
    *,
    worker: str = WORKER,
    now: float | None = None,
    ttl_s: float = 10.0,
    policy: Policy = POLICY,
    origin: str = ORIGIN,
) -> str:
    return mint(
        policy,
        BROKER,
        job_id=job_id,
        payload_sha256=payload_digest(payload),
        data_class=DATA_CLASS,
        origin_zone=origin,
        target_worker=worker,
        now=time.time() if now is None else now,
        ttl_s=ttl_s,
    )


def flip_bit(text: str, index: int = 40) -> str:
    """The token with one base64url character changed (so one bit of a field flips)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    value = alphabet.index(text[index]) ^ 1
    return text[:index] + alphabet[value] + text[index + 1 :]


@dataclass(frozen=True)
class WorkSpec:
    """One work message: what the edge would publish to the worker's topic."""

    payload: bytes = JPEG
    job_id: str = ""
    token: str | None = None  # None: a valid token for (job_id, payload); "": no token
    model: str = "defect-v1"
    deadline_at_ms: float | None = None
    priority: int | None = None
    content_type: str | None = "image/jpeg"
    edge: str = EDGE  # the edge whose work topic carries it: the sender
    edge_property: str | None = None  # None: the topic's edge, as an edge sends it; "": absent
    origin_property: str = ORIGIN  # the origin-zone the message declares (not trusted)
    attempt: str | None = None  # the attempt property as sent; None: absent (attempt 1)
    correlation: bytes = b""
    model_sha256: str | None = None  # the model file the edge runs; None: not said

    def user_properties(self, job_id: str) -> list[tuple[str, str]]:
        tok = token(job_id, self.payload) if self.token is None else self.token
        props = [
            (topics.PROP_JOB_ID, job_id),
            (topics.PROP_MODEL, self.model),
            (topics.PROP_DATA_CLASS, DATA_CLASS),
            (topics.PROP_ORIGIN_ZONE, self.origin_property),
        ]
        named = self.edge if self.edge_property is None else self.edge_property
        if named:
            props.append((topics.PROP_EDGE, named))
        if self.attempt is not None:
            props.append((topics.PROP_ATTEMPT, self.attempt))
        if self.model_sha256 is not None:
            props.append((topics.PROP_MODEL_SHA256, self.model_sha256))
        if tok:
            props.append((topics.PROP_TOKEN, tok))
        if self.deadline_at_ms is not None:
            props.append((topics.PROP_DEADLINE_AT, f"{self.deadline_at_ms:.0f}"))
        if self.priority is not None:
            props.append((topics.PROP_PRIORITY, str(self.priority)))
        return props

    def message(self, zone: str = WORKER_ZONE, worker: str = WORKER) -> Message:
        job_id = self.job_id or uuid.uuid4().hex
        return Message(
            topics.pool_work(zone, worker, self.edge),
            self.payload,
            qos=1,
            correlation_data=self.correlation or job_id.encode(),
            content_type=self.content_type,
            user_properties=tuple(self.user_properties(job_id)),
        )
