"""Policy signing and the trust decision, modelled on The Update Framework (TUF).

Signers sign the policy's canonical digest (detached signatures in a ``.sig`` JSON file).
``accept_policy`` decides whether a policy may replace the last accepted one, described by a
``TrustAnchor`` that the caller persists: it must carry its own threshold of distinct signer
keys; when the signer keys or threshold change, also the previous threshold of previous keys;
its version may not go back; it may not be expired. Thresholds count distinct raw public keys,
never key ids or signature entries. Pure: ``now`` is passed in, and nothing here reads files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies.canonical import canonical_json, digest_text
from policies.errors import (
    BadSignature,
    PolicyDigestMismatch,
    PolicyExpired,
    PolicyParseError,
    PolicyRollback,
    PolicyVersionConflict,
    RotationNotAuthorised,
    ThresholdNotMet,
    UnknownSigner,
)
from policies.keys import (
    SigningKey,
    b64u_decode,
    b64u_encode,
    decode_public_key,
    fingerprint,
    public_key_text,
    signature_valid,
)
from policies.loader import format_loc, parse_canonical
from policies.model import Policy, Rollout, rollout_of
from policies.schema import KeyText, NodeId, RolloutDoc, format_time
from policies.verdict import Candidate, Verdict, read_verdict, require_verdict

SIGNATURES_FORMAT = "sluicegate-policy-signatures/1"
ANCHOR_FORMAT = "sluicegate-policy-anchor/1"
ENVELOPE_KEYS = frozenset({"policy", "signatures", "verdict"})
DOMAIN = b"sluicegate-policy-signature/1\n"


@dataclass(frozen=True)
class PolicySignature:
    key_id: str
    public: bytes
    signature: bytes


@dataclass(frozen=True)
class SignatureBundle:
    """The detached signatures over one policy digest."""

    version: int
    digest: bytes
    signatures: tuple[PolicySignature, ...]


@dataclass(frozen=True)
class TrustAnchor:
    """What the caller persists about the last accepted policy."""

    version: int
    digest: bytes
    threshold: int
    signer_keys: frozenset[bytes]
    rollout: Rollout | None = None  # the accepted policy's [rollout]: what the next needs

    @classmethod
    def of(cls, policy: Policy) -> TrustAnchor:
        return cls(
            policy.version,
            policy.digest,
            policy.signer_threshold,
            policy.signer_keys,
            policy.rollout,
        )


def sign_policy(policy: Policy, key: SigningKey, key_id: str) -> PolicySignature:
    """Sign ``policy``'s digest. ``key_id`` is a label for people; trust uses the key bytes."""
    return PolicySignature(key_id, key.public, key.sign(DOMAIN + policy.digest))


def add_signature(
    bundle: SignatureBundle | None, policy: Policy, signature: PolicySignature
) -> SignatureBundle:
    """``bundle`` plus ``signature``; starts afresh if ``bundle`` signs another digest."""
    kept: tuple[PolicySignature, ...] = ()
    if bundle is not None and bundle.digest == policy.digest:
        kept = tuple(s for s in bundle.signatures if s.public != signature.public)
    return SignatureBundle(policy.version, policy.digest, (*kept, signature))


def _describe_keys(policy: Policy) -> str:
    return ", ".join(f"{r.key_id} ({fingerprint(r.public).hex()})" for r in policy.signers)


def accept_policy(
    policy: Policy,
    bundle: SignatureBundle,
    *,
    now: float,
    anchor: TrustAnchor | None,
    verdict: Verdict | None = None,
) -> TrustAnchor:
    """Accept ``policy`` or raise the ``PolicyRefused`` subclass that says why.

    ``anchor`` is the last accepted policy (None only on first install, which then trusts the
    policy's own signers: pin its digest out of band). Returns the anchor to persist. When
    the accepted policy's ``[rollout]`` requires it, a new version needs ``verdict``, a
    passing twin verdict for its digest (``policies.verdict.check_verdict``).
    """
    if bundle.digest != policy.digest:
        raise PolicyDigestMismatch(
            f"policy v{policy.version} has digest {digest_text(policy.digest)} but its "
            f"signatures cover {digest_text(bundle.digest)}: the policy changed after it was "
            "signed; restore the signed file or have it signed again"
        )
    known = policy.signer_keys | (anchor.signer_keys if anchor else frozenset())
    valid: set[bytes] = set()
    for n, sig in enumerate(bundle.signatures):
        if sig.public not in known:
            raise UnknownSigner(
                f"signature {n} (key id {sig.key_id!r}, fingerprint "
                f"{fingerprint(sig.public).hex()}) is by a key that signs neither this policy "
                f"nor the accepted one; accepted signers: {_describe_keys(policy)}"
            )
        if not signature_valid(sig.public, sig.signature, DOMAIN + bundle.digest):
            raise BadSignature(
                f"signature {n} (key id {sig.key_id!r}) does not verify over "
                f"{digest_text(bundle.digest)}; expected an Ed25519 signature by that key"
            )
        valid.add(sig.public)
    own = valid & policy.signer_keys
    if len(own) < policy.signer_threshold:
        raise ThresholdNotMet(
            f"policy v{policy.version} needs {policy.signer_threshold} distinct signer keys, "
            f"got {len(own)} ({len(bundle.signatures)} signature entries; duplicates and one "
            f"key under several ids count once); accepted signers: {_describe_keys(policy)}"
        )
    if anchor is not None:
        if policy.version < anchor.version:
            raise PolicyRollback(
                f"policy version {policy.version} is older than the accepted version "
                f"{anchor.version}; accepted: version {anchor.version} or newer"
            )
        if policy.version == anchor.version and policy.digest != anchor.digest:
            raise PolicyVersionConflict(
                f"policy version {policy.version} has digest {digest_text(policy.digest)} but "
                f"the accepted version {anchor.version} has {digest_text(anchor.digest)}; a "
                "changed policy needs a higher version"
            )
        rotated = (
            policy.signer_keys != anchor.signer_keys or policy.signer_threshold != anchor.threshold
        )
        old = valid & anchor.signer_keys
        if rotated and len(old) < anchor.threshold:
            raise RotationNotAuthorised(
                f"policy v{policy.version} changes the signer keys or threshold, so "
                f"{anchor.threshold} distinct keys of the previous signers (v{anchor.version}) "
                f"must also sign it; {len(old)} did"
            )
        if policy.digest != anchor.digest:
            candidate = Candidate(kind="policy", digest=policy.digest.hex(), version=policy.version)
            require_verdict(anchor.rollout, verdict, candidate)
    if now >= policy.expires:
        raise PolicyExpired(
            f"policy v{policy.version} expired at {format_time(policy.expires)}; accepted: a "
            "policy whose 'expires' is in the future (have a new version signed)"
        )
    return TrustAnchor.of(policy)


class SignatureDoc(BaseModel):
    """One detached signature as files and messages carry it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    key_id: NodeId
    key: KeyText
    sig: str = Field(pattern=r"^[A-Za-z0-9_-]{86}$")


class _BundleDoc(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    format: str = Field(pattern=f"^{SIGNATURES_FORMAT}$")
    version: int = Field(ge=1)
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    signatures: list[SignatureDoc] = Field(max_length=64)


class _AnchorDoc(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    format: str = Field(pattern=f"^{ANCHOR_FORMAT}$")
    version: int = Field(ge=1)
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    threshold: int = Field(ge=1)
    signers: list[KeyText] = Field(min_length=1, max_length=64)
    rollout: RolloutDoc | None = None  # the accepted policy's gate, as its file writes it


_M = TypeVar("_M", bound=BaseModel)


def validate_json(model: type[_M], data: bytes, source: str) -> _M:
    """``data`` as ``model``, or the PolicyParseError that names the first bad key."""
    try:
        return model.model_validate(json.loads(data))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise PolicyParseError(
            f"{first['msg']}; got {first['input']!r:.60}",
            source=source,
            key=format_loc(tuple(first["loc"])),
        ) from exc
    except (ValueError, RecursionError) as exc:
        raise PolicyParseError(f"not JSON: {exc}", source=source) from exc


def signatures_of(docs: list[SignatureDoc]) -> tuple[PolicySignature, ...]:
    """Detached signatures as a file carries them, decoded."""
    return tuple(
        PolicySignature(s.key_id, decode_public_key(s.key), b64u_decode(s.sig)) for s in docs
    )


def signatures_doc(signatures: tuple[PolicySignature, ...]) -> list[dict[str, str]]:
    """Detached signatures as a file carries them."""
    return [
        {"key_id": s.key_id, "key": public_key_text(s.public), "sig": b64u_encode(s.signature)}
        for s in signatures
    ]


def parse_signatures(data: bytes, *, source: str = "<signatures>") -> SignatureBundle:
    doc = validate_json(_BundleDoc, data, source)
    return SignatureBundle(
        doc.version,
        bytes.fromhex(doc.digest.removeprefix("sha256:")),
        signatures_of(doc.signatures),
    )


def signatures_json(bundle: SignatureBundle) -> dict[str, object]:
    return {
        "format": SIGNATURES_FORMAT,
        "version": bundle.version,
        "digest": digest_text(bundle.digest),
        "signatures": signatures_doc(bundle.signatures),
    }


def dump_signatures(bundle: SignatureBundle) -> bytes:
    return (json.dumps(signatures_json(bundle), indent=2) + "\n").encode("ascii")


def parse_anchor(data: bytes, *, source: str = "<anchor>") -> TrustAnchor:
    doc = validate_json(_AnchorDoc, data, source)
    return TrustAnchor(
        doc.version,
        bytes.fromhex(doc.digest.removeprefix("sha256:")),
        doc.threshold,
        frozenset(decode_public_key(k) for k in doc.signers),
        rollout_of(doc.rollout),
    )


def dump_anchor(anchor: TrustAnchor) -> bytes:
    doc = {
        "format": ANCHOR_FORMAT,
        "version": anchor.version,
        "digest": digest_text(anchor.digest),
        "threshold": anchor.threshold,
        "signers": sorted(public_key_text(k) for k in anchor.signer_keys),
    }
    gate = anchor.rollout
    if gate is not None:
        rollout: dict[str, object] = {
            "twin_keys": {k: public_key_text(v) for k, v in sorted(gate.twin_keys.items())},
            "require_verdict": gate.require_verdict,
            "min_attainment": gate.min_attainment,
            "max_queue_depth": gate.max_queue_depth,
        }
        if gate.min_burst != 1.0:
            rollout["min_burst"] = gate.min_burst
        if gate.max_drop_points is not None:
            rollout["max_drop_points"] = gate.max_drop_points
        doc["rollout"] = rollout
    return (json.dumps(doc, indent=2) + "\n").encode("ascii")


def signed_envelope(
    policy: Policy, bundle: SignatureBundle, verdict: Verdict | None = None
) -> bytes:
    """The policy and its signatures in one message (e.g. the retained policy topic), with
    the twin verdict that lets it through a gated rollout, if it has one."""
    doc: dict[str, object] = {
        "policy": json.loads(policy.canonical),
        "signatures": signatures_json(bundle),
    }
    if verdict is not None:
        doc["verdict"] = json.loads(verdict.to_bytes())
    return canonical_json(doc)


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def open_envelope(
    data: bytes, *, now: float, anchor: TrustAnchor | None, source: str = "<signed policy>"
) -> tuple[Policy, TrustAnchor]:
    """Parse a ``signed_envelope`` message and accept its policy (see ``accept_policy``)."""
    try:
        raw = json.loads(data, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise PolicyParseError(f"not JSON: {exc}", source=source) from exc
    if not isinstance(raw, dict) or not {"policy", "signatures"} <= set(raw) <= ENVELOPE_KEYS:
        raise PolicyParseError(
            "expected an object with the keys 'policy' and 'signatures' (and 'verdict', "
            "for a gated rollout)",
            source=source,
        )
    policy = parse_canonical(canonical_json(raw["policy"]), source=source)
    bundle = parse_signatures(canonical_json(raw["signatures"]), source=source)
    verdict = (
        read_verdict(canonical_json(raw["verdict"]), source=source) if "verdict" in raw else None
    )
    return policy, accept_policy(policy, bundle, now=now, anchor=anchor, verdict=verdict)
