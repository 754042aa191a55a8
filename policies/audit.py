"""The tamper-evident audit log: records of decisions and refusals, each signed and chained
to the previous record's hash; verification names the first broken record.

This core knows nothing of storage: a store appends encoded records, returns the last one and
iterates them (``AuditStore``; files in ``audit_file``, Redis streams in ``redis_stores``).
One log has one chain; a record carries its signer's public key, and the verifier decides
which keys it trusts. It never rewrites or drops a record, and never reads the clock.

A record's hash is sha256 of its canonical body (everything but the signature); the signature
covers ``DOMAIN`` + that hash. Deleting a record breaks the sequence at its position,
reordering breaks it at the first moved record, editing breaks that record's signature.
Cutting records off the end is only visible against a head hash kept elsewhere
(``expected_head``).

The asyncio writer remembers the digest of each record it stored (``entry_digest``, sha256 of the
stored bytes, signature included; the last ``WITNESS_MOST``). A verifier given those
(``witnessed``) skips the signature of a record whose stored bytes still have that digest:
they are the bytes the writer signed. Every other check still runs on it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies.canonical import canonical_json
from policies.errors import (
    AuditChainBroken,
    AuditConflict,
    AuditError,
    AuditUntrustedSigner,
    PolicyError,
)
from policies.keys import SigningKey, b64u_decode, b64u_encode, fingerprint, signature_valid

DOMAIN = b"sluicegate-audit-record/1\n"
GENESIS = bytes(32)
MAX_RECORD_BYTES = 16_384
WITNESS_MOST = 200_000  # digests a writer keeps of the records it stored, newest
Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class AuditRecord:
    seq: int
    time_ms: int
    kind: str
    data: Mapping[str, Scalar]
    prev: bytes
    signer: bytes
    signature: bytes = b""

    def _fields(self) -> dict[str, object]:
        return {
            "seq": self.seq,
            "t": self.time_ms,
            "kind": self.kind,
            "data": dict(self.data),
            "prev": self.prev.hex(),
            "signer": b64u_encode(self.signer),
        }

    def body(self) -> bytes:
        return canonical_json(self._fields())

    @property
    def hash(self) -> bytes:
        return hashlib.sha256(self.body()).digest()

    def encode(self) -> bytes:
        """One line of canonical JSON, without the newline."""
        return canonical_json({**self._fields(), "sig": b64u_encode(self.signature)})


class _RecordDoc(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    seq: int = Field(ge=0)
    t: int = Field(ge=0)
    kind: str = Field(pattern=r"^[a-z][a-z0-9_.-]{0,31}$")
    data: dict[str, Scalar]
    prev: str = Field(pattern=r"^[0-9a-f]{64}$")
    signer: str = Field(pattern=r"^[A-Za-z0-9_-]{43}$")
    sig: str = Field(pattern=r"^[A-Za-z0-9_-]{86}$")


def decode_record(entry: bytes) -> AuditRecord:
    """Parse one stored record; ``ValueError`` says why it cannot be read."""
    if len(entry) > MAX_RECORD_BYTES:
        raise ValueError(f"{len(entry)} bytes; a record has at most {MAX_RECORD_BYTES}")
    try:
        doc = _RecordDoc.model_validate(json.loads(entry))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise ValueError(f"field {'.'.join(map(str, first['loc']))}: {first['msg']}") from exc
    except RecursionError as exc:
        raise ValueError("nested too deeply") from exc
    return AuditRecord(
        doc.seq,
        doc.t,
        doc.kind,
        doc.data,
        bytes.fromhex(doc.prev),
        b64u_decode(doc.signer),
        b64u_decode(doc.sig),
    )


def entry_digest(entry: bytes) -> bytes:
    """What a writer remembers of a record it stored: sha256 of the stored bytes."""
    return hashlib.sha256(entry).digest()


def next_record(
    head: AuditRecord | None,
    kind: str,
    data: Mapping[str, Scalar],
    *,
    now: float,
    key: SigningKey,
) -> AuditRecord:
    """The signed record that follows ``head`` (None: the first record of a log)."""
    for value in data.values():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"audit data must be finite numbers, got {value!r}")
    unsigned = AuditRecord(
        seq=0 if head is None else head.seq + 1,
        time_ms=int(now * 1000),
        kind=kind,
        data=dict(data),
        prev=GENESIS if head is None else head.hash,
        signer=key.public,
    )
    record = replace(unsigned, signature=key.sign(DOMAIN + unsigned.hash))
    decode_record(record.encode())  # refuse to write what could not be read back
    return record


@dataclass(frozen=True)
class ChainSummary:
    count: int
    head: bytes
    signers: frozenset[bytes]


def _fingerprints(keys: Collection[bytes], most: int = 8) -> str:
    shown = sorted(fingerprint(k).hex() for k in keys)
    more = f" and {len(shown) - most} more" if len(shown) > most else ""
    return ", ".join(shown[:most]) + more


def verify_chain(
    entries: Iterable[bytes],
    trusted: Collection[bytes],
    *,
    expected_head: bytes | None = None,
    after: ChainSummary | None = None,
    witnessed: Mapping[int, bytes] | None = None,
) -> ChainSummary:
    """Check every record; raise ``AuditChainBroken`` at the first bad one, or
    ``AuditUntrustedSigner`` at the first signed by a key outside ``trusted``.

    ``after``: a summary this verifier returned earlier for the same log; ``entries`` are
    then the records that follow it (from seq ``after.count``), checked as a continuation
    of its head, and the summary returned covers the whole log. That is how a long log is
    verified in bounded steps, or only its new records.

    ``witnessed``: seq -> ``entry_digest`` of records the verifier's own writer stored; a
    record whose bytes still have that digest is not signature-checked again."""
    prev = GENESIS if after is None else after.head
    signers: set[bytes] = set() if after is None else set(after.signers)
    count = 0 if after is None else after.count
    for index, entry in enumerate(entries, start=count):
        try:
            record = decode_record(entry)
        except ValueError as exc:
            raise AuditChainBroken(f"unreadable: {exc}", index=index, problem="unreadable") from exc
        if record.signer not in trusted:
            raise AuditUntrustedSigner(
                f"(seq {record.seq}) signed by key {fingerprint(record.signer).hex()}, which is "
                f"not trusted; trusted: {_fingerprints(trusted)}",
                index=index,
                signer=record.signer,
            )
        digest = record.hash
        own = witnessed is not None and witnessed.get(index) == entry_digest(entry)
        if not own and not signature_valid(record.signer, record.signature, DOMAIN + digest):
            raise AuditChainBroken(
                f"(seq {record.seq}) signature does not verify: the record was edited",
                index=index,
                problem="bad-signature",
            )
        if record.seq != index:
            raise AuditChainBroken(
                f"has seq {record.seq}, expected {index}: a record was deleted or records were "
                "reordered",
                index=index,
                problem="sequence",
            )
        if record.prev != prev:
            raise AuditChainBroken(
                f"(seq {record.seq}) does not chain to record {index - 1}: a record was replaced",
                index=index,
                problem="broken-link",
            )
        prev = digest
        signers.add(record.signer)
        count = index + 1
    if expected_head is not None and prev != expected_head:
        raise AuditChainBroken(
            f"the log ends at head {prev.hex()[:16]}…, expected {expected_head.hex()[:16]}…: "
            "records were cut off the end",
            index=count,
            problem="truncated",
        )
    return ChainSummary(count, prev, frozenset(signers))


class AuditStore(Protocol):
    def append(self, seq: int, entry: bytes) -> None:
        """Store ``entry`` as record ``seq``; ``AuditConflict`` if ``seq`` is already taken."""

    def last(self) -> bytes | None:
        """The last stored entry, or None for an empty log."""

    def entries(self) -> Iterable[bytes]:
        """Every entry, oldest first."""


class AsyncAuditStore(Protocol):
    async def append(self, seq: int, entry: bytes) -> None:
        """Store ``entry`` as record ``seq``; ``AuditConflict`` if ``seq`` is already taken."""

    async def last(self) -> bytes | None:
        """The last stored entry, or None for an empty log."""


def _head(entry: bytes | None) -> AuditRecord | None:
    if entry is None:
        return None
    try:
        return decode_record(entry)
    except ValueError as exc:
        raise AuditError(
            f"the log's last record is unreadable ({exc}); run 'sluicegate policy audit-verify' "
            "and repair the log before appending"
        ) from exc


class AuditWriter:
    """Appends signed, chained records to one store; re-reads the head after a conflict."""

    def __init__(self, store: AuditStore, key: SigningKey, *, retries: int = 3) -> None:
        self.store, self.key, self.retries = store, key, retries
        self._head: AuditRecord | None = None
        self._loaded = False

    def append(self, kind: str, data: Mapping[str, Scalar], *, now: float) -> AuditRecord:
        attempt = 0
        while True:
            if not self._loaded:
                self._head, self._loaded = _head(self.store.last()), True
            record = next_record(self._head, kind, data, now=now, key=self.key)
            try:
                self.store.append(record.seq, record.encode())
            except AuditConflict:
                self._loaded = False
                if attempt >= self.retries:
                    raise
                attempt += 1
                continue
            self._head = record
            return record


class AsyncAuditWriter:
    """``AuditWriter`` for asyncio callers and an ``AsyncAuditStore``; it keeps the digests
    of the records it stored (``witnessed``) for the process's own verifier."""

    def __init__(self, store: AsyncAuditStore, key: SigningKey, *, retries: int = 3) -> None:
        self.store, self.key, self.retries = store, key, retries
        self._head: AuditRecord | None = None
        self._loaded = False
        # seq -> entry_digest of what this writer stored, oldest first, for its verifier.
        self.witnessed: dict[int, bytes] = {}

    def forget(self, below: int) -> None:
        """Drop the digests of records before seq ``below``: a verifier has checked them."""
        self.witnessed = {seq: d for seq, d in self.witnessed.items() if seq >= below}

    async def append(self, kind: str, data: Mapping[str, Scalar], *, now: float) -> AuditRecord:
        attempt = 0
        while True:
            if not self._loaded:
                self._head, self._loaded = _head(await self.store.last()), True
            record = next_record(self._head, kind, data, now=now, key=self.key)
            entry = record.encode()
            try:
                await self.store.append(record.seq, entry)
            except AuditConflict:
                self._loaded = False
                if attempt >= self.retries:
                    raise
                attempt += 1
                continue
            self._head = record
            self.witnessed[record.seq] = entry_digest(entry)
            if len(self.witnessed) > WITNESS_MOST:  # no verifier for a while: keep the newest half
                self.forget(record.seq - WITNESS_MOST // 2)
            return record


def refusal_data(exc: PolicyError, **context: Scalar) -> dict[str, Scalar]:
    """Audit data for a refusal: its reason code and message, plus the caller's context."""
    return {"reason": exc.reason, "message": str(exc)[:1000], **context}
