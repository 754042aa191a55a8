"""Shared by the pool worker tests: the test policy, tokens minted with the published test
broker key, and work messages built the way an edge agent sends them (results come back on
the edge's returns topic, ``topics.edge_returns(spec.edge)``)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from policies import Policy, mint, payload_digest, signed_envelope
from policies.signing import dump_signatures
from sluicegate import topics
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
POLICY = policy_of(base_doc(version=1))
JPEG, TRUTH = sample_jpeg(21)


def envelope(policy: Policy = POLICY) -> bytes:
    return signed_envelope(policy, signed(policy, *OFFICERS))


def write_policy_file(folder: Path, version: int = 1) -> Path:
    """A signed policy file with its ``.sig`` beside it, as an operator installs one."""
    doc = base_doc(version=version)
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
) -> str:
    return mint(
        policy,
        BROKER,
        job_id=job_id,
        payload_sha256=payload_digest(payload),
        data_class=DATA_CLASS,
        origin_zone=ORIGIN,
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
    edge: str | None = EDGE  # None: no edge-id property
    attempt: str | None = None  # the attempt property as sent; None: absent (attempt 1)
    correlation: bytes = b""

    def user_properties(self, job_id: str) -> list[tuple[str, str]]:
        tok = token(job_id, self.payload) if self.token is None else self.token
        props = [
            (topics.PROP_JOB_ID, job_id),
            (topics.PROP_MODEL, self.model),
            (topics.PROP_DATA_CLASS, DATA_CLASS),
            (topics.PROP_ORIGIN_ZONE, ORIGIN),
        ]
        if self.edge is not None:
            props.append((topics.PROP_EDGE, self.edge))
        if self.attempt is not None:
            props.append((topics.PROP_ATTEMPT, self.attempt))
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
            topics.pool_work(zone, worker),
            self.payload,
            qos=1,
            correlation_data=self.correlation or job_id.encode(),
            content_type=self.content_type,
            user_properties=tuple(self.user_properties(job_id)),
        )
