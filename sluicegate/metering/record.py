"""Usage records: what one node says it ran, signed by it, numbered and hash-chained per
node, and countersigned by the broker replica that accepted it.

A record is written by the node that ran an attempt (a pool worker, or an edge agent for a
job it ran itself) before the result leaves the node, and says: which job and attempt,
under which placement token, for which line (the edge that owns the job) and owner (the
app), on which model file, backend and device class, how long it took on the device (the
job's share of its batch), how long it queued, the bytes it took in, the digest of the
result, and the status. An edge also writes a ``settled`` record when it delivers an
offloaded job's result: which worker's attempt it delivered (a sister campus's worker named
``<worker>@<campus>``; a worker's record of a sister campus's job names that campus in
``campus``). Billing takes, for each job,
the attempt its edge settled; every other attempt that ran is waste (a lost worker, a
fenced return), recorded but not billed to the line.

Each record carries ``seq`` (1, 2, 3 ... per node: a gap or a repeat is visible) and
``prev``, the digest of the node's previous signed record (32 zero bytes before the first),
so a record altered, removed or inserted breaks the node's chain. Times are integer
milliseconds and durations integer microseconds, so the signed bytes are the same in any
language that can write sorted, compact JSON.

This module is pure: no clock (times are passed in), no files, no network.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from policies.keys import SigningKey, signature_valid

RECORD_DOMAIN = b"sluicegate-usage/1\n"
RECEIPT_DOMAIN = b"sluicegate-usage-receipt/1\n"
GENESIS = bytes(32)
Event = Literal["ran", "settled"]
NodeKind = Literal["pool", "edge"]
_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_HEX64 = r"^[0-9a-f]{64}$"


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Usage(_Doc):
    """One attempt that ran (``ran``), or an edge's settlement of an offloaded job
    (``settled``: ``settled_node``/``settled_attempt`` name the attempt delivered)."""

    v: Literal[1] = 1
    node: str = Field(pattern=_ID)
    kind: NodeKind
    seq: int = Field(ge=1)
    prev: str = Field(pattern=_HEX64)  # hex digest of the node's previous signed record
    at_ms: int = Field(ge=0)  # when the node wrote it
    event: Event
    job_id: str = Field(min_length=1, max_length=200)
    attempt: int = Field(ge=0, le=1000)  # 0: a job the edge ran itself, never placed
    token_id: str = Field("", pattern=r"^([0-9a-f]{32})?$")  # the placement token's nonce
    line: str = Field(pattern=_ID)  # the edge that owns the job
    owner: str = Field("", max_length=64)  # the app, from the policy; "" when not known
    data_class: str = Field("", max_length=64)
    zone: str = Field(max_length=128)  # where it ran
    model: str = Field("", max_length=128)
    model_sha256: str = Field("", pattern=r"^([0-9a-f]{64})?$")
    backend: str = Field("", max_length=128)
    device_class: str = Field("", max_length=64)
    device_us: int = Field(0, ge=0)  # the job's share of its batch's time on the device
    queue_us: int = Field(0, ge=0)
    batch_size: int = Field(1, ge=1)
    bytes_in: int = Field(0, ge=0)
    result_sha256: str = Field("", pattern=r"^([0-9a-f]{64})?$")
    status: str = Field(max_length=16)
    settled_node: str = Field("", max_length=64)
    settled_attempt: int = Field(0, ge=0, le=1000)
    # The sister campus whose job a pool worker ran ("" for this campus's; left out of the
    # signed bytes then, so records written before it keep their signatures).
    campus: str = Field("", max_length=64)

    def canonical(self) -> bytes:
        body = self.model_dump(mode="json")
        if not body["campus"]:
            del body["campus"]
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode(
            "ascii"
        )


class Receipt(_Doc):
    """A broker replica's countersignature: it accepted the record at ``received_ms``."""

    broker: str = Field(pattern=_ID)
    received_ms: int = Field(ge=0)
    sig: str  # base64url Ed25519 over RECEIPT_DOMAIN + record digest + broker + received_ms


class SignedUsage(_Doc):
    """A record with its node's signature, as the node ships it; ``receipt`` once accepted."""

    record: Usage
    sig: str  # base64url Ed25519 over RECORD_DOMAIN + record.canonical()
    receipt: Receipt | None = None

    def digest(self, canonical: bytes | None = None) -> bytes:
        """What the node's next record names as ``prev``: the record and its signature
        (``canonical``: the record's :meth:`Usage.canonical`, if the caller has it)."""
        body = self.record.canonical() if canonical is None else canonical
        return hashlib.sha256(RECORD_DOMAIN + body + _raw(self.sig)).digest()

    def node_signature_valid(self, public: bytes, canonical: bytes | None = None) -> bool:
        body = self.record.canonical() if canonical is None else canonical
        return signature_valid(public, _raw(self.sig), RECORD_DOMAIN + body)

    def receipt_valid(self, public: bytes) -> bool:
        if self.receipt is None:
            return False
        message = _receipt_message(self.digest(), self.receipt.broker, self.receipt.received_ms)
        return signature_valid(public, _raw(self.receipt.sig), message)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _raw(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError:
        return b""


def _receipt_message(digest: bytes, broker: str, received_ms: int) -> bytes:
    """What ``broker`` signs for the record of digest ``digest`` it took at ``received_ms``."""
    return RECEIPT_DOMAIN + digest + broker.encode("ascii") + b"\n" + str(received_ms).encode()


def sign_usage(record: Usage, key: SigningKey) -> SignedUsage:
    return SignedUsage(record=record, sig=_b64(key.sign(RECORD_DOMAIN + record.canonical())))


def countersign(
    signed: SignedUsage,
    key: SigningKey,
    *,
    broker: str,
    received_ms: int,
    digest: bytes | None = None,
) -> SignedUsage:
    """``signed`` with this broker's receipt (any earlier receipt replaced); ``digest``:
    ``signed.digest()``, if the caller has it."""
    body = signed.digest() if digest is None else digest
    message = _receipt_message(body, broker, received_ms)
    receipt = Receipt(broker=broker, received_ms=received_ms, sig=_b64(key.sign(message)))
    return signed.model_copy(update={"receipt": receipt})


def to_line(signed: SignedUsage) -> bytes:
    """One record as one line of an export (JSON, no newline inside)."""
    return signed.model_dump_json().encode("utf-8")


def from_line(line: bytes | str) -> SignedUsage:
    """A record read back; pydantic's ``ValidationError`` when it is not one."""
    return SignedUsage.model_validate_json(line)


class NodeHead(_Doc):
    """One node's part of an export: its records ``first_seq`` to ``last_seq``, all there,
    the last one's digest."""

    node: str = Field(pattern=_ID)
    first_seq: int = Field(ge=1)
    last_seq: int = Field(ge=1)
    last_digest: str = Field(pattern=_HEX64)


class Manifest(_Doc):
    """The last line of an export, signed by the broker replica that made it: the period,
    each node's head, and the sha256 of the record lines before it (each line and its
    newline), so a record removed from the end of a node's run, or any line changed, shows."""

    v: Literal[1] = 1
    broker: str = Field(pattern=_ID)
    exported_ms: int = Field(ge=0)
    from_ms: int = Field(ge=0)
    to_ms: int = Field(ge=0)
    heads: list[NodeHead]
    records_sha256: str = Field(pattern=_HEX64)
    sig: str = ""
    # A settlement export with a sister campus: the records of both campuses that concern
    # the jobs between them (``sluicegate.metering.peering``); "" for a campus's own export.
    peer: str = Field("", max_length=64)

    def signed_bytes(self) -> bytes:
        body = self.model_copy(update={"sig": ""}).model_dump(mode="json")
        if not body["peer"]:  # left out: a campus's own exports keep their signed bytes
            del body["peer"]
        return MANIFEST_DOMAIN + json.dumps(
            body, sort_keys=True, separators=(",", ":"), ensure_ascii=True
        ).encode("ascii")

    def signature_valid(self, public: bytes) -> bool:
        return signature_valid(public, _raw(self.sig), self.signed_bytes())


class ManifestLine(_Doc):
    manifest: Manifest


MANIFEST_DOMAIN = b"sluicegate-usage-export/1\n"


def export_lines(
    records: list[SignedUsage],
    key: SigningKey,
    *,
    broker: str,
    exported_ms: int,
    from_ms: int,
    to_ms: int,
    peer: str = "",
) -> list[bytes]:
    """An export: one line per record (ordered by node, then seq), then the signed manifest.
    Each returned line has no newline; join them with ``b"\\n"`` and end with one. With
    ``peer``, a settlement export with that sister campus (``records`` in the order given:
    ours, then theirs; no heads, since neither side's chains are whole in it)."""
    ordered = records if peer else sorted(records, key=lambda s: (s.record.node, s.record.seq))
    lines = [to_line(s) for s in ordered]
    digest = hashlib.sha256(b"".join(line + b"\n" for line in lines)).hexdigest()
    heads: dict[str, NodeHead] = {}
    for signed in [] if peer else ordered:
        r = signed.record
        first = heads[r.node].first_seq if r.node in heads else r.seq
        heads[r.node] = NodeHead(
            node=r.node, first_seq=first, last_seq=r.seq, last_digest=signed.digest().hex()
        )
    manifest = Manifest(
        broker=broker,
        exported_ms=exported_ms,
        from_ms=from_ms,
        to_ms=to_ms,
        heads=list(heads.values()),
        records_sha256=digest,
        peer=peer,
    )
    manifest = manifest.model_copy(update={"sig": _b64(key.sign(manifest.signed_bytes()))})
    return [*lines, ManifestLine(manifest=manifest).model_dump_json().encode("utf-8")]


def sign_chained(record: Usage, key: SigningKey) -> tuple[SignedUsage, bytes]:
    """:func:`sign_usage` and the signed record's :meth:`SignedUsage.digest` (what the next
    record's ``prev`` names), its canonical bytes made once: a ledger's hot path."""
    body = RECORD_DOMAIN + record.canonical()
    raw = key.sign(body)
    return SignedUsage(record=record, sig=_b64(raw)), hashlib.sha256(body + raw).digest()
