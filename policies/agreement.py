"""Bilateral agreements between campuses: each side's signed half, and whether they are in
force.

A campus's half (:class:`Statement`) is its policy's entry for the peer, the terms each way,
under that policy's version and expiry, signed by that campus's officers; a policy that no
longer lists the peer makes a half with no terms: the withdrawal. Campus A holds the
agreement with B in force only while A's accepted policy lists B and A holds B's half, signed
by a threshold of the officer keys A's entry pins for B, unexpired, and saying the same terms
mirrored (what A sends is what B receives, and the other way). Halves are compared, never
merged: a field that differs names itself, and nothing is in force.

:class:`PeerBook` keeps the newest half heard from each peer: an older version is a replay,
refused and counted by whoever catches :class:`AgreementRefused`; a newer one replaces it,
a withdrawal included. Pure: ``now`` is passed in, nothing here reads files or the network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from policies.canonical import canonical_json, digest, digest_text
from policies.errors import (
    AgreementBadSignature,
    AgreementRefused,
    AgreementReplayed,
    AgreementThresholdNotMet,
    AgreementUnknownSigner,
    AgreementWrongParties,
)
from policies.keys import (
    SigningKey,
    signature_valid,
)
from policies.model import Policy
from policies.peers import Peer, Terms
from policies.schema import Name, TermsDoc, Timestamp, format_time
from policies.signing import (
    PolicySignature,
    SignatureDoc,
    signatures_doc,
    signatures_of,
    validate_json,
)

STATEMENT_FORMAT = "sluicegate-peer-agreement/1"
DOMAIN = b"sluicegate-peer-agreement/1\n"

StandingCode = Literal["in_force", "not_listed", "no_statement", "withdrawn", "expired", "mismatch"]


@dataclass(frozen=True)
class Statement:
    """One campus's half of an agreement with ``peer``: its terms (None: withdrawn) as its
    policy ``version`` says them until ``expires``, and its officers' signatures."""

    campus: str
    peer: str
    version: int
    expires: int
    send: Terms | None
    receive: Terms | None
    signatures: tuple[PolicySignature, ...] = ()

    @property
    def withdrawn(self) -> bool:
        return self.send is None

    def body(self) -> dict[str, Any]:
        terms = None
        if self.send is not None and self.receive is not None:
            terms = {"send": self.send.as_json(), "receive": self.receive.as_json()}
        return {
            "format": STATEMENT_FORMAT,
            "campus": self.campus,
            "peer": self.peer,
            "version": self.version,
            "expires": format_time(self.expires),
            "terms": terms,
        }

    @property
    def digest(self) -> bytes:
        """What the officers sign: the sha256 of the body's canonical JSON."""
        return digest(canonical_json(self.body()))

    def signed_by(self, key: SigningKey, key_id: str) -> Statement:
        """This half with ``key``'s signature added (one by the same key replaced)."""
        kept = tuple(s for s in self.signatures if s.public != key.public)
        signature = PolicySignature(key_id, key.public, key.sign(DOMAIN + self.digest))
        return Statement(
            self.campus,
            self.peer,
            self.version,
            self.expires,
            self.send,
            self.receive,
            (*kept, signature),
        )

    def signer_keys(self) -> frozenset[bytes]:
        """The distinct keys whose signatures verify over this half."""
        message = DOMAIN + self.digest
        return frozenset(
            s.public for s in self.signatures if signature_valid(s.public, s.signature, message)
        )

    def to_bytes(self) -> bytes:
        doc = {
            **self.body(),
            "digest": digest_text(self.digest),
            "signatures": signatures_doc(self.signatures),
        }
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("ascii")


def statement_for(policy: Policy, peer: str) -> Statement:
    """``policy``'s half for ``peer``, unsigned: its terms, or a withdrawal if it does not
    list the peer."""
    entry = policy.peers.get(peer)
    send = entry.send if entry is not None else None
    receive = entry.receive if entry is not None else None
    return Statement(policy.campus, peer, policy.version, policy.expires, send, receive)


class _TermsPair(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    send: TermsDoc
    receive: TermsDoc


class _StatementDoc(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    format: str = Field(pattern=f"^{STATEMENT_FORMAT}$")
    campus: Name
    peer: Name
    version: int = Field(ge=1)
    expires: Timestamp
    terms: _TermsPair | None
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    signatures: list[SignatureDoc] = Field(max_length=32)


def parse_statement(data: bytes, *, source: str = "<agreement>") -> Statement:
    """A half as written by :meth:`Statement.to_bytes` (signatures not checked here)."""
    doc = validate_json(_StatementDoc, data, source)
    pair = doc.terms
    statement = Statement(
        doc.campus,
        doc.peer,
        doc.version,
        doc.expires,
        Terms.of(pair.send) if pair is not None else None,
        Terms.of(pair.receive) if pair is not None else None,
        signatures_of(doc.signatures),
    )
    if digest_text(statement.digest) != doc.digest:
        raise AgreementBadSignature(
            f"{source}: the half's digest {doc.digest} is not that of its body "
            f"({digest_text(statement.digest)}): it was changed after it was written"
        )
    return statement


def verify_statement(ours: Policy, statement: Statement) -> Peer:
    """Check that ``statement`` is the half of a peer our policy lists, addressed to us and
    signed by a threshold of the officer keys our entry pins; returns that entry."""
    if statement.peer != ours.campus:
        raise AgreementWrongParties(
            f"{statement.campus!r}'s half is addressed to {statement.peer!r}, not to this "
            f"campus {ours.campus!r}"
        )
    entry = ours.peers.get(statement.campus)
    if entry is None:
        raise AgreementWrongParties(
            f"a half from {statement.campus!r}, which policy v{ours.version} of "
            f"{ours.campus!r} does not list under [peers]; listed: "
            f"{', '.join(sorted(ours.peers)) or 'none'}"
        )
    message = DOMAIN + statement.digest
    valid: set[bytes] = set()
    for n, sig in enumerate(statement.signatures):
        if sig.public not in entry.officer_keys:
            raise AgreementUnknownSigner(
                f"signature {n} (key id {sig.key_id!r}) of {statement.campus!r}'s half is by "
                f"a key that is not one of the {len(entry.officer_keys)} officer keys "
                f"[peers.{statement.campus}] pins"
            )
        if not signature_valid(sig.public, sig.signature, message):
            raise AgreementBadSignature(
                f"signature {n} (key id {sig.key_id!r}) of {statement.campus!r}'s half does "
                "not verify over its body"
            )
        valid.add(sig.public)
    have = len(valid)
    if have < entry.officer_threshold:
        raise AgreementThresholdNotMet(
            f"{statement.campus!r}'s half v{statement.version} carries {have} distinct "
            f"officer signature(s); [peers.{statement.campus}] needs "
            f"{entry.officer_threshold}"
        )
    return entry


def own_half_problem(ours: Policy, statement: Statement) -> str | None:
    """Why ``statement`` is not this campus's half to publish under policy ``ours`` (None:
    it is): another campus's, other terms than our entry says now (a withdrawal when the
    entry is gone), or fewer distinct signatures of our officers than our threshold."""
    if statement.campus != ours.campus:
        return f"it is {statement.campus!r}'s half, not {ours.campus!r}'s"
    now = statement_for(ours, statement.peer)
    if (statement.send, statement.receive) != (now.send, now.receive):
        what = "a withdrawal" if now.withdrawn else "other terms"
        return (
            f"policy v{ours.version} says {what} for {statement.peer!r} than this half "
            f"v{statement.version}: have the officers sign it again (policy peer-sign)"
        )
    have = len(statement.signer_keys() & ours.signer_keys)
    if have < ours.signer_threshold:
        return (
            f"it carries {have} of the {ours.signer_threshold} officer signatures policy "
            f"v{ours.version} needs"
        )
    return None


@dataclass(frozen=True)
class Standing:
    """Where an agreement with one peer stands, and why, in words an officer can act on."""

    peer: str
    code: StandingCode
    reason: str
    version: int | None = None  # the peer's half's version, when one is held

    @property
    def in_force(self) -> bool:
        return self.code == "in_force"


def judge(ours: Policy, peer: str, theirs: Statement | None, *, now: float) -> Standing:
    """Whether the agreement with ``peer`` is in force: our entry, their (verified) half,
    unexpired, with the terms mirrored."""
    entry = ours.peers.get(peer)
    if entry is None:
        return Standing(peer, "not_listed", f"policy v{ours.version} does not list {peer!r}")
    if theirs is None:
        return Standing(peer, "no_statement", f"no signed half from {peer!r} yet")
    version = theirs.version
    if theirs.send is None or theirs.receive is None:
        return Standing(peer, "withdrawn", f"{peer!r} withdrew at its v{version}", version)
    if now >= theirs.expires:
        return Standing(
            peer,
            "expired",
            f"{peer!r}'s half v{version} expired at {format_time(theirs.expires)}",
            version,
        )
    wrong = [f"send {d}" for d in entry.send.differences(theirs.receive)]
    wrong += [f"receive {d}" for d in entry.receive.differences(theirs.send)]
    if wrong:
        return Standing(
            peer,
            "mismatch",
            f"our terms vs {peer!r}'s mirrored (ours vs theirs): " + "; ".join(wrong),
            version,
        )
    return Standing(
        peer, "in_force", f"both sides signed the same terms ({peer!r} v{version})", version
    )


@dataclass
class PeerBook:
    """The newest verified half from each peer, and how many were refused (by reason)."""

    halves: dict[str, Statement] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)

    def offer(self, ours: Policy, statement: Statement) -> bool:
        """Keep ``statement`` if it is a valid, newer half; False if it is the one held.
        Raises the ``AgreementRefused`` that says why, after counting it."""
        try:
            verify_statement(ours, statement)
            held = self.halves.get(statement.campus)
            if held is not None:
                if statement.version < held.version:
                    raise AgreementReplayed(
                        f"{statement.campus!r}'s half v{statement.version} is older than "
                        f"the v{held.version} already held"
                    )
                if statement.version == held.version:
                    if statement.digest != held.digest:
                        raise AgreementReplayed(
                            f"{statement.campus!r}'s half v{statement.version} says other "
                            "terms than the half of that version already held"
                        )
                    return False
        except AgreementRefused as exc:
            self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
            raise
        self.halves[statement.campus] = statement
        return True

    def judge(self, ours: Policy, peer: str, *, now: float) -> Standing:
        return judge(ours, peer, self.halves.get(peer), now=now)
