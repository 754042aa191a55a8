"""The policy file's data model as pydantic v2 models: the one place untrusted policy bytes
become typed values, and the source of the published JSON Schema.

It validates shape, names and ranges, and normalises values (key text, rule text, timestamps)
so that the canonical form is unique. It checks nothing that needs the whole document at once
beyond ``semantic_problems`` and never decides trust: signatures live in ``signing``.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StringConstraints,
    WithJsonSchema,
)

from policies.keys import decode_public_key, public_key_text
from policies.sealing import decode_seal_key, seal_key_text

FORMAT = "sluicegate-policy/1"
MAX_VERSION = 2**32 - 1
MAX_EDGES = 65_536  # line PCs one policy may list (a large campus has thousands)

_SEG = r"[a-z0-9][a-z0-9._-]*"
ZONE_RE = rf"^{_SEG}(/{_SEG}){{0,7}}$"
PATTERN_RE = rf"^(({_SEG}|\*)/){{0,7}}({_SEG}|\*|\*\*)$"
_PATTERN = re.compile(PATTERN_RE)

NodeId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Name = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,31}$")]
ZoneName = Annotated[str, StringConstraints(pattern=ZONE_RE, max_length=64)]
MetricName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
Text = Annotated[str, StringConstraints(max_length=500)]


def _normalise_key(text: str) -> str:
    return public_key_text(decode_public_key(text))


KeyText = Annotated[
    str,
    AfterValidator(_normalise_key),
    WithJsonSchema({"type": "string", "pattern": "^ed25519:[A-Za-z0-9_-]{43}$"}),
]


def _normalise_seal_key(text: str) -> str:
    return seal_key_text(decode_seal_key(text))


SealKeyText = Annotated[
    str,
    AfterValidator(_normalise_seal_key),
    WithJsonSchema({"type": "string", "pattern": "^x25519:[A-Za-z0-9_-]{43}$"}),
]
MAX_SEAL_KEYS = 4  # per worker: the current key and those still open for in-flight jobs


def _normalise_rule(text: str) -> str:
    parts = [part.strip() for part in text.split("->")]
    if len(parts) > 2 or not all(_PATTERN.match(part) and len(part) <= 64 for part in parts):
        raise ValueError(
            f"{text[:80]!r} is not a rule; expected a zone pattern such as 'campus/**', "
            "'campus/*/dc' or 'offsite/cloud-east', optionally preceded by an origin pattern "
            "and '->' ('campus/fab-north/** -> campus/fab-north/**'); '**' only at the end"
        )
    return " -> ".join(parts)


RuleText = Annotated[
    str,
    StringConstraints(max_length=140),
    AfterValidator(_normalise_rule),
    WithJsonSchema({"type": "string", "maxLength": 140, "description": "[origin ->] target"}),
]


def _parse_time(value: object) -> int:
    if isinstance(value, str):
        text = value
        try:
            value = dt.datetime.fromisoformat(text)
        except ValueError as exc:
            raise ValueError(f"{text[:40]!r} is not a date-time like 2027-06-30T00:00:00Z") from exc
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise ValueError("a date-time needs a time zone, e.g. 2027-06-30T00:00:00Z")
        if value.microsecond:
            raise ValueError("use whole seconds, e.g. 2027-06-30T00:00:00Z")
        seconds = int(value.timestamp())
    elif isinstance(value, dt.date):
        seconds = int(dt.datetime(value.year, value.month, value.day, tzinfo=dt.UTC).timestamp())
    else:
        raise ValueError(f"expected a date-time like 2027-06-30T00:00:00Z, got {value!r:.40}")
    if not 946684800 <= seconds < 253402300800:
        raise ValueError("a date-time between year 2000 and 9999 is expected")
    return seconds


def format_time(seconds: int) -> str:
    """``2027-06-30T00:00:00Z`` for epoch seconds."""
    return dt.datetime.fromtimestamp(seconds, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


Timestamp = Annotated[
    int,
    BeforeValidator(_parse_time),
    PlainSerializer(format_time, return_type=str),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class SignersDoc(_Model):
    """Policy signers: the root of trust. ``threshold`` distinct keys must sign."""

    threshold: int = Field(ge=1, le=16)
    keys: dict[NodeId, KeyText] = Field(min_length=1, max_length=32)


class BrokersDoc(_Model):
    """Keys the broker signs placement tokens with."""

    keys: dict[NodeId, KeyText] = Field(default_factory=dict, max_length=64)


def _workers_table(value: object) -> object:
    if isinstance(value, list):
        raise ValueError(
            "workers is a table of worker id = its Ed25519 key, e.g. "
            '{ north-gpu-1 = "ed25519:…" }; a list of ids names no keys, so no worker '
            "could prove who it is (add each worker's key from 'sluicegate enroll list')"
        )
    return value


class PoolDoc(_Model):
    """Workers in one zone, each with the Ed25519 key it made on its server: the key its
    TLS client certificate carries and its audit records are signed with."""

    zone: ZoneName
    description: Text = ""
    workers: Annotated[dict[NodeId, KeyText], BeforeValidator(_workers_table)] = Field(
        min_length=1, max_length=1000
    )
    # Each worker's HPKE (X25519) public keys, which edges seal images to: the current one
    # and, while a rotation runs, the previous ones. Left out of the canonical form when
    # empty, so policies written before it keep their digests.
    encryption_keys: dict[
        NodeId, Annotated[list[SealKeyText], Field(min_length=1, max_length=MAX_SEAL_KEYS)]
    ] = Field(default_factory=dict, max_length=1000)


class EdgeDoc(_Model):
    zone: ZoneName
    key: KeyText
    description: Text = ""


# A topic prefix an app receives results under: plain MQTT levels, no wildcards, nothing
# under the protocol's own tree (an edge may publish results there).
def _check_prefix(text: str) -> str:
    if text.split("/", 1)[0] == "sluicegate":
        raise ValueError(
            f"{text!r} is inside the protocol's own topics; choose a prefix of your own, "
            "e.g. 'app/line-3'"
        )
    return text


ResultsPrefix = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+){0,7}$", max_length=128),
    AfterValidator(_check_prefix),
]


class AppDoc(_Model):
    """A vision app: the edges it may submit jobs to, and the topic prefixes under which it
    takes their results (besides ``sluicegate/v1/clients/<app id>/results``, always its)."""

    description: Text = ""
    edges: list[NodeId] = Field(min_length=1, max_length=MAX_EDGES)
    results: list[ResultsPrefix] = Field(default_factory=list, max_length=16)


class ClassDoc(_Model):
    """A data class: which zones may process it. Deny wins; anything not allowed is denied."""

    description: Text = ""
    allow: list[RuleText] = Field(default_factory=list, max_length=256)
    deny: list[RuleText] = Field(default_factory=list, max_length=256)
    # Images of a confidential class travel only sealed to the chosen worker's key; left
    # out of the canonical form when false.
    confidential: bool = False


class ConditionDoc(_Model):
    metric: MetricName
    op: Literal[">=", ">", "<=", "<"]
    value: float = Field(allow_inf_nan=False)


class SubhealthDoc(_Model):
    """A node is sub-healthy when every condition of one rule holds."""

    name: Name
    when: list[ConditionDoc] = Field(min_length=1, max_length=8)


class TokensDoc(_Model):
    max_ttl_s: int = Field(default=120, ge=1, le=3600)
    max_skew_s: int = Field(default=5, ge=0, le=300)


class RolloutDoc(_Model):
    """Changes rehearsed in the digital twin before they are accepted: the twin keys whose
    verdicts count, whether the next policy version needs a passing verdict, and what a
    rehearsal must have shown (``policies.verdict.Thresholds``)."""

    twin_keys: dict[NodeId, KeyText] = Field(default_factory=dict, max_length=16)
    require_verdict: bool = False
    min_attainment: float = Field(default=0.95, ge=0.0, le=1.0)
    max_queue_depth: int = Field(default=64, ge=0, le=1_000_000)
    # The arrivals a rehearsal must have multiplied by (a 2x, 5x, 10x burst) at least; left
    # out of the canonical form when not set, so gated policies keep their digests.
    min_burst: float | None = Field(default=None, ge=1.0, le=100.0)
    # The points of deadline attainment a candidate may lose against the policy in force
    # replayed on the same trace (overall, per line, per data class); left out of the
    # canonical form when not set.
    max_drop_points: float | None = Field(default=None, ge=0.0, le=100.0)


class TermsDoc(_Model):
    """One direction of a peer agreement: which data classes may cross, into which of the
    receiving campus's zones, how much a second, and what the receiver charges for it."""

    classes: list[Name] = Field(default_factory=list, max_length=128)
    zones: list[ZoneName] = Field(default_factory=list, max_length=256)
    max_jobs_per_s: float = Field(default=0.0, ge=0.0, le=1e6, allow_inf_nan=False)
    max_bytes_per_s: float = Field(default=0.0, ge=0.0, le=1e12, allow_inf_nan=False)
    currency: str = Field(default="", max_length=16)
    device_second: float = Field(default=0.0, ge=0.0, le=1e6, allow_inf_nan=False)
    job: float = Field(default=0.0, ge=0.0, le=1e6, allow_inf_nan=False)


class PeerDoc(_Model):
    """A sister campus this campus may exchange work with (``[peers.<campus>]``): who it is
    (its CA certificate's fingerprint, its broker replicas' keys, its officers' keys and
    threshold) and the terms each way. It is in force only while the peer's officers have
    signed the matching entry for this campus (``policies.agreement``)."""

    description: Text = ""
    ca_fingerprint: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    brokers: dict[NodeId, KeyText] = Field(min_length=1, max_length=64)
    officers: SignersDoc
    send: TermsDoc = Field(default_factory=TermsDoc)  # our jobs on the peer's workers
    receive: TermsDoc = Field(default_factory=TermsDoc)  # the peer's jobs on our workers


class PolicyDocument(_Model):
    """A Sluicegate compliance policy (``sluicegate-policy/1``)."""

    format: Literal["sluicegate-policy/1"]
    campus: Name
    version: int = Field(ge=1, le=MAX_VERSION)
    expires: Timestamp
    description: Text = ""
    policy_signers: SignersDoc
    broker_signers: BrokersDoc = Field(default_factory=BrokersDoc)
    zones: dict[ZoneName, Text] = Field(min_length=1, max_length=4096)
    pools: dict[NodeId, PoolDoc] = Field(default_factory=dict, max_length=1000)
    edges: dict[NodeId, EdgeDoc] = Field(default_factory=dict, max_length=MAX_EDGES)
    apps: dict[NodeId, AppDoc] = Field(default_factory=dict, max_length=4096)
    classes: dict[Name, ClassDoc] = Field(min_length=1, max_length=128)
    subhealth: list[SubhealthDoc] = Field(default_factory=list, max_length=64)
    tokens: TokensDoc = Field(default_factory=TokensDoc)
    rollout: RolloutDoc | None = None
    peers: dict[Name, PeerDoc] = Field(default_factory=dict, max_length=64)


Loc = tuple[str | int, ...]


def semantic_problems(doc: PolicyDocument) -> list[tuple[Loc, str]]:
    """Problems that make a schema-valid document unusable, each with where it is."""
    problems: list[tuple[Loc, str]] = []
    distinct = len(set(doc.policy_signers.keys.values()))
    if doc.policy_signers.threshold > distinct:
        problems.append(
            (
                ("policy_signers", "threshold"),
                f"threshold {doc.policy_signers.threshold} can never be met: only {distinct} "
                f"distinct signer key(s); accepted: 1 to {distinct}",
            )
        )
    if doc.rollout is not None and doc.rollout.require_verdict and not doc.rollout.twin_keys:
        problems.append(
            (
                ("rollout", "require_verdict"),
                "require_verdict = true needs at least one twin key in twin_keys, or no "
                "verdict could ever be accepted",
            )
        )
    seen: dict[str, str] = {}
    for pool_name, pool in doc.pools.items():
        for worker in pool.workers:
            if worker in seen:
                problems.append(
                    (
                        ("pools", pool_name, "workers", worker),
                        f"worker {worker!r} is already in pool {seen[worker]!r}; "
                        "a worker sits in exactly one pool",
                    )
                )
            seen[worker] = pool_name
        for worker, keys in pool.encryption_keys.items():
            if worker not in pool.workers:
                problems.append(
                    (
                        ("pools", pool_name, "encryption_keys", worker),
                        f"encryption keys for {worker!r}, which is not a worker of pool "
                        f"{pool_name!r}; its workers: {', '.join(sorted(pool.workers))}",
                    )
                )
            if len(set(keys)) != len(keys):
                problems.append(
                    (
                        ("pools", pool_name, "encryption_keys", worker),
                        f"worker {worker!r} lists the same encryption key twice",
                    )
                )
    problems.extend(_peer_problems(doc))
    for app_name, app in doc.apps.items():
        for index, edge in enumerate(app.edges):
            if edge not in doc.edges:
                problems.append(
                    (
                        ("apps", app_name, "edges", index),
                        f"app {app_name!r} names edge {edge!r}, which the policy does not "
                        f"list; known edges: {', '.join(sorted(doc.edges)) or 'none'}",
                    )
                )
    return problems


def _peer_problems(doc: PolicyDocument) -> list[tuple[Loc, str]]:
    """A peer entry names classes this policy defines, our zones for what we receive and
    the peer's own zones (none of ours) for what we send, and a threshold its officers can
    meet."""
    problems: list[tuple[Loc, str]] = []
    known = ", ".join(sorted(doc.classes))
    for name, peer in doc.peers.items():
        if name == doc.campus:
            problems.append((("peers", name), "a campus is not its own peer"))
        distinct = len(set(peer.officers.keys.values()))
        if peer.officers.threshold > distinct:
            problems.append(
                (
                    ("peers", name, "officers", "threshold"),
                    f"threshold {peer.officers.threshold} can never be met: only {distinct} "
                    f"distinct officer key(s) listed for {name!r}",
                )
            )
        for way, terms in (("send", peer.send), ("receive", peer.receive)):
            for index, cls in enumerate(terms.classes):
                if cls not in doc.classes:
                    problems.append(
                        (
                            ("peers", name, way, "classes", index),
                            f"class {cls!r} is not a class of this policy; known: {known}",
                        )
                    )
            ours = way == "receive"
            for index, zone in enumerate(terms.zones):
                if (zone in doc.zones) != ours:
                    whose = "ours, where its jobs run" if ours else f"{name}'s, not ours"
                    problems.append(
                        (
                            ("peers", name, way, "zones", index),
                            f"zone {zone!r}: the zones to {way} in are {whose}",
                        )
                    )
    return problems


def json_schema() -> dict[str, Any]:
    """The published JSON Schema of the policy file (its TOML read as JSON)."""
    schema = PolicyDocument.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://sluicegate.dev/schema/policy.schema.json"
    return schema


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
