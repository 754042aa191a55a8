"""Placement tokens: minted by the broker, verified by the edge and the worker.

A token binds job id, payload sha256, data class, origin zone, target worker and zone, policy
version and (first 16 bytes of the) digest, issue and expiry time, a random nonce (the
token's id) and the id of the worker's sealing key the image must be encrypted to (zeros:
sent in the clear; never for a class the policy marks confidential), signed with a broker
key the policy trusts. The layout is fixed binary, then base64url: at most 400
characters. ``verify`` is pure (``now`` passed in), and so is ``verify_peer``, an edge's
check of a token a sister campus's broker signed; the replay check is separate
(``policies.replay``) because it needs state. This module never looks at a clock, never
stores anything, and never accepts a token it has not fully checked.

Layout (big-endian): version u8 | signer fingerprint 8 | payload sha256 32 | policy version u32
| policy digest[:16] | issued-at ms u64 | expires-at ms u64 | nonce 16 | seal key id 8 |
five strings, each u8
length + UTF-8 (job id, data class, origin zone, target worker, target zone) | Ed25519
signature 64 over ``DOMAIN`` + everything before it.

The policy digest is cut to 16 bytes: it only pins which policy the broker used, inside the
broker's signature, and the version is checked with it; forging a match would need a 128-bit
second preimage on a policy that the threshold of signers also signed.
"""

from __future__ import annotations

import binascii
import hashlib
import os
import struct
from dataclasses import dataclass

from policies.errors import (
    PlacementDenied,
    TokenBadSignature,
    TokenExpired,
    TokenLifetimeTooLong,
    TokenMalformed,
    TokenNotSealed,
    TokenNotYetValid,
    TokenPayloadMismatch,
    TokenPolicyMismatch,
    TokenTooLarge,
    TokenUnknownSealKey,
    TokenUntrustedSigner,
    TokenWrongClass,
    TokenWrongJob,
    TokenWrongOrigin,
    TokenWrongTarget,
    TokenZoneDenied,
)
from policies.evaluate import allowed, peer_origin
from policies.keys import SIGNATURE_BYTES, SigningKey, fingerprint, signature_valid
from policies.model import Policy
from policies.sealing import NO_KEY, work_info

TOKEN_VERSION = 2
DOMAIN = b"sluicegate-placement-token/2\n"
MAX_ENCODED = 400
MAX_RAW = MAX_ENCODED * 3 // 4
DEFAULT_TTL_S = 30.0
_HEAD = struct.Struct(">B8s32sI16sQQ16s8s")
_STRING_NAMES = ("job id", "data class", "origin zone", "target worker", "target zone")
STRING_BUDGET = MAX_RAW - _HEAD.size - SIGNATURE_BYTES - len(_STRING_NAMES)
MIN_RAW = _HEAD.size + 2 * len(_STRING_NAMES) + SIGNATURE_BYTES


@dataclass(frozen=True)
class PlacementClaims:
    """What a token says. Times are integer milliseconds since the epoch."""

    job_id: str
    payload_sha256: bytes
    data_class: str
    origin_zone: str
    target_worker: str
    target_zone: str
    policy_version: int
    policy_digest: bytes
    issued_at_ms: int
    expires_at_ms: int
    nonce: bytes
    signer: bytes = b""
    seal_key_id: bytes = NO_KEY

    @property
    def sealed(self) -> bool:
        """Whether the image must travel sealed to the target worker's key."""
        return self.seal_key_id != NO_KEY

    @property
    def token_id(self) -> bytes:
        return self.nonce

    def seal_info(self) -> bytes:
        """The HPKE info the image is sealed under: this placement and no other."""
        return work_info(
            token_id=self.nonce,
            key_id=self.seal_key_id,
            job_id=self.job_id,
            data_class=self.data_class,
            origin_zone=self.origin_zone,
            target_worker=self.target_worker,
            target_zone=self.target_zone,
        )

    def body(self, signer: bytes) -> bytes:
        head = _HEAD.pack(
            TOKEN_VERSION,
            signer,
            self.payload_sha256,
            self.policy_version,
            self.policy_digest,
            self.issued_at_ms,
            self.expires_at_ms,
            self.nonce,
            self.seal_key_id,
        )
        parts = [head]
        for text in (
            self.job_id,
            self.data_class,
            self.origin_zone,
            self.target_worker,
            self.target_zone,
        ):
            raw = text.encode("utf-8")
            parts.append(bytes((len(raw),)) + raw)
        return b"".join(parts)


def payload_digest(payload: bytes) -> bytes:
    """The sha256 a token binds: of the exact payload bytes published to the worker."""
    return hashlib.sha256(payload).digest()


def seal(claims: PlacementClaims, key: SigningKey) -> str:
    """Sign and encode ``claims`` with no policy checks at all; ``mint`` is the checked path."""
    sizes = [len(s.encode("utf-8")) for s in _strings(claims)]
    if sum(sizes) > STRING_BUDGET or max(sizes) > 255:
        named = ", ".join(f"{n} {s} B" for n, s in zip(_STRING_NAMES, sizes, strict=True))
        raise TokenTooLarge(
            f"names use {sum(sizes)} bytes ({named}); a token has room for {STRING_BUDGET} "
            f"bytes of names so that it stays within {MAX_ENCODED} characters"
        )
    body = claims.body(key.fingerprint)
    raw = body + key.sign(DOMAIN + body)
    return binascii.b2a_base64(raw, newline=False).rstrip(b"=").translate(_TO_URL).decode()


_TO_URL = bytes.maketrans(b"+/", b"-_")
_FROM_URL = bytes.maketrans(b"-_", b"+/")


def _strings(claims: PlacementClaims) -> tuple[str, ...]:
    return (
        claims.job_id,
        claims.data_class,
        claims.origin_zone,
        claims.target_worker,
        claims.target_zone,
    )


def mint(
    policy: Policy,
    key: SigningKey,
    *,
    job_id: str,
    payload_sha256: bytes,
    data_class: str,
    origin_zone: str,
    target_worker: str,
    now: float,
    ttl_s: float = DEFAULT_TTL_S,
    nonce: bytes | None = None,
    seal_key_id: bytes = NO_KEY,
) -> str:
    """A signed token for a placement ``policy`` allows; raises ``PlacementDenied`` if not,
    and ``TokenNotSealed``/``TokenUnknownSealKey`` when the sealing key does not fit."""
    if key.public not in policy.broker_keys_by_fp.get(key.fingerprint, ()):
        raise TokenUntrustedSigner(
            f"key {key.fingerprint.hex()} is not a broker signer of policy v{policy.version}; "
            f"broker signers: {', '.join(r.key_id for r in policy.brokers) or 'none'}"
        )
    if len(payload_sha256) != 32:
        raise ValueError(f"payload_sha256 must be 32 bytes, got {len(payload_sha256)}")
    if not 0 < ttl_s <= policy.max_ttl_s:
        raise TokenLifetimeTooLong(
            f"ttl {ttl_s:g} s; policy v{policy.version} accepts 0 < ttl <= {policy.max_ttl_s} s"
        )
    target_zone = policy.worker_zone(target_worker)
    if target_zone is None:
        raise PlacementDenied(f"worker {target_worker!r} is in no pool of policy v{policy.version}")
    verdict = allowed(policy, data_class, origin_zone, target_zone)
    if not verdict.allowed:
        raise PlacementDenied(f"placement on {target_worker!r}: {verdict}")
    _check_seal(policy, data_class, target_worker, seal_key_id)
    issued = int(now * 1000)
    claims = PlacementClaims(
        job_id=job_id,
        payload_sha256=payload_sha256,
        data_class=data_class,
        origin_zone=origin_zone,
        target_worker=target_worker,
        target_zone=target_zone,
        policy_version=policy.version,
        policy_digest=policy.digest[:16],
        issued_at_ms=issued,
        expires_at_ms=issued + int(ttl_s * 1000),
        nonce=os.urandom(16) if nonce is None else nonce,
        seal_key_id=seal_key_id,
    )
    return seal(claims, key)


def _check_seal(policy: Policy, data_class: str, worker: str, key_id: bytes) -> None:
    if key_id == NO_KEY:
        if policy.confidential(data_class):
            raise TokenNotSealed(
                f"policy v{policy.version} marks class {data_class!r} confidential: its images "
                f"travel only sealed, and the placement on {worker!r} binds no sealing key"
            )
        return
    if policy.seal_key(worker, key_id) is None:
        raise TokenUnknownSealKey(
            f"sealing key {key_id.hex()} is not one policy v{policy.version} lists for worker "
            f"{worker!r}; listed: "
            + (", ".join(k.hex() for k in _listed(policy, worker)) or "none")
        )


def _listed(policy: Policy, worker: str) -> list[bytes]:
    entry = policy.worker(worker)
    return list(entry.seal_keys) if entry is not None else []


def _decode(token: str) -> tuple[PlacementClaims, bytes, bytes]:
    """Claims, signed body and signature, or ``TokenMalformed``."""
    if len(token) > MAX_ENCODED or not token.isascii():
        raise TokenMalformed(f"a token is at most {MAX_ENCODED} base64url characters")
    text = token.encode("ascii")
    try:
        raw = binascii.a2b_base64(
            text.translate(_FROM_URL) + b"=" * (-len(text) % 4), strict_mode=True
        )
    except binascii.Error as exc:
        raise TokenMalformed(f"not base64url: {exc}") from exc
    if len(raw) < MIN_RAW or raw[0] != TOKEN_VERSION:
        raise TokenMalformed(
            f"{len(raw)} bytes starting {raw[:1].hex()!r}; accepted: a version-"
            f"{TOKEN_VERSION} token of {MIN_RAW} to {MAX_RAW} bytes"
        )
    body, signature = raw[:-SIGNATURE_BYTES], raw[-SIGNATURE_BYTES:]
    _, signer, payload, pver, pdigest, iat, exp, nonce, seal_id = _HEAD.unpack_from(body)
    strings: list[str] = []
    pos = _HEAD.size
    for name in _STRING_NAMES:
        size = body[pos] if pos < len(body) else 0
        chunk = body[pos + 1 : pos + 1 + size]
        if size == 0 or len(chunk) != size:
            raise TokenMalformed(f"the {name} field is empty or cut short")
        try:
            strings.append(chunk.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise TokenMalformed(f"the {name} field is not UTF-8") from exc
        pos += 1 + size
    if pos != len(body):
        raise TokenMalformed(f"{len(body) - pos} unexpected bytes after the names")
    job, cls, origin, worker, zone = strings
    claims = PlacementClaims(
        job, payload, cls, origin, worker, zone, pver, pdigest, iat, exp, nonce, signer, seal_id
    )
    return claims, body, signature


def peek(token: str) -> PlacementClaims:
    """Decode without verifying anything: for logs and ``explain`` only, never for decisions."""
    return _decode(token)[0]


def _untrusted(policy: Policy, signer: bytes) -> TokenUntrustedSigner:
    roles = [
        f"{role} {ref_id!r}"
        for role, ref_id, public in (
            *(("policy signer", r.key_id, r.public) for r in policy.signers),
            *(("edge", e.edge_id, e.key) for e in policy.edges),
        )
        if fingerprint(public) == signer
    ]
    known = f"it belongs to {roles[0]}" if roles else "the key is unknown"
    brokers = ", ".join(r.key_id for r in policy.brokers) or "none"
    return TokenUntrustedSigner(
        f"token signed by key {signer.hex()}: {known}; policy v{policy.version} trusts only "
        f"broker signers for placements: {brokers}"
    )


def verify(
    token: str,
    policy: Policy,
    *,
    now: float,
    job_id: str,
    payload_sha256: bytes | None,
    worker_id: str | None = None,
    origin_zone: str | None = None,
    data_class: str | None = None,
) -> PlacementClaims:
    """Check everything but replay; return the claims or raise a ``TokenRefused`` subclass.

    The worker passes ``worker_id`` (itself); the edge passes ``origin_zone`` (its zone).
    ``payload_sha256=None`` leaves the payload to :func:`check_payload`: a worker given a
    sealed image opens it only after everything else here passed.
    """
    claims, body, signature = _decode(token)
    keys = policy.broker_keys_by_fp.get(claims.signer)
    if keys is None:
        raise _untrusted(policy, claims.signer)
    message = DOMAIN + body
    if not any(signature_valid(k, signature, message) for k in keys):
        raise TokenBadSignature("the token's signature does not verify: it was altered or forged")
    if claims.policy_version != policy.version or claims.policy_digest != policy.digest[:16]:
        raise TokenPolicyMismatch(
            f"token minted under policy v{claims.policy_version} ({claims.policy_digest.hex()}), "
            f"this node holds v{policy.version} ({policy.digest[:16].hex()}); accepted: the same"
        )
    _check_time(claims, policy, now)
    if claims.job_id != job_id:
        raise TokenWrongJob(f"token is for job {claims.job_id!r}, attached to job {job_id!r}")
    if payload_sha256 is not None:
        check_payload(claims, payload_sha256)
    if data_class is not None and claims.data_class != data_class:
        raise TokenWrongClass(f"token is for class {claims.data_class!r}, job says {data_class!r}")
    if origin_zone is not None and claims.origin_zone != origin_zone:
        raise TokenWrongOrigin(
            f"token is for origin zone {claims.origin_zone!r}, this node is in {origin_zone!r}"
        )
    if worker_id is not None and claims.target_worker != worker_id:
        raise TokenWrongTarget(
            f"token targets worker {claims.target_worker!r}; this worker is {worker_id!r}"
        )
    zone = policy.worker_zone(claims.target_worker)
    if zone != claims.target_zone:
        raise TokenWrongTarget(
            f"token places worker {claims.target_worker!r} in zone {claims.target_zone!r}; "
            f"policy v{policy.version} puts it in {zone!r}"
        )
    verdict = allowed(policy, claims.data_class, claims.origin_zone, claims.target_zone)
    if not verdict.allowed:
        raise TokenZoneDenied(str(verdict))
    _check_seal(policy, claims.data_class, claims.target_worker, claims.seal_key_id)
    return claims


def verify_peer(
    token: str,
    policy: Policy,
    peer: str,
    *,
    now: float,
    job_id: str,
    payload_sha256: bytes,
    data_class: str,
) -> PlacementClaims:
    """An edge's check of a placement a sister campus's broker signed for one of this
    campus's jobs: a broker key this policy's ``[peers.<peer>]`` entry pins, this job and
    payload, a class the entry's ``send`` terms list, this campus as its origin
    (``peer:<campus>``), one of the peer's zones the terms list, and sealed when this policy
    marks the class confidential. The peer's own policy (its version, its workers) is the
    peer's to check: its worker verifies the same token against it."""
    entry = policy.peers.get(peer)
    if entry is None:
        raise TokenUntrustedSigner(
            f"a placement from campus {peer!r}: policy v{policy.version} names no such "
            f"sister campus ({', '.join(sorted(policy.peers)) or 'none'})"
        )
    claims, body, signature = _decode(token)
    keys = [k for k in entry.brokers.values() if fingerprint(k) == claims.signer]
    if not keys:
        raise TokenUntrustedSigner(
            f"token signed by key {claims.signer.hex()}, not a broker of {peer!r} that "
            f"policy v{policy.version} pins: {', '.join(sorted(entry.brokers)) or 'none'}"
        )
    if not any(signature_valid(k, signature, DOMAIN + body) for k in keys):
        raise TokenBadSignature("the token's signature does not verify: it was altered or forged")
    _check_time(claims, policy, now)
    if claims.job_id != job_id:
        raise TokenWrongJob(f"token is for job {claims.job_id!r}, attached to job {job_id!r}")
    check_payload(claims, payload_sha256)
    if claims.data_class != data_class:
        raise TokenWrongClass(f"token is for class {claims.data_class!r}, job says {data_class!r}")
    origin = peer_origin(policy.campus)
    if claims.origin_zone != origin:
        raise TokenWrongOrigin(
            f"token is for origin {claims.origin_zone!r}; a job of this campus is {origin!r} "
            f"on {peer!r}"
        )
    terms = entry.send
    if data_class not in terms.classes or claims.target_zone not in terms.zones:
        raise TokenZoneDenied(
            f"class {data_class!r} in {peer!r}'s zone {claims.target_zone!r}: policy "
            f"v{policy.version} sends it classes {sorted(terms.classes)} in zones "
            f"{sorted(terms.zones)}"
        )
    if claims.seal_key_id == NO_KEY and policy.confidential(data_class):
        raise TokenNotSealed(
            f"policy v{policy.version} marks class {data_class!r} confidential: its images "
            f"travel only sealed, and {peer!r}'s placement binds no sealing key"
        )
    return claims


def check_payload(claims: PlacementClaims, payload_sha256: bytes) -> None:
    """The payload (the opened plaintext, when sealed) is the one the token was minted for."""
    if claims.payload_sha256 != payload_sha256:
        raise TokenPayloadMismatch(
            f"payload sha256 {payload_sha256.hex()[:16]}… but the token binds "
            f"{claims.payload_sha256.hex()[:16]}…: the image is not the one placed"
        )


def _check_time(claims: PlacementClaims, policy: Policy, now: float) -> None:
    now_ms = int(now * 1000)
    skew_ms = policy.max_skew_s * 1000
    if claims.issued_at_ms > now_ms + skew_ms:
        raise TokenNotYetValid(
            f"token issued {(claims.issued_at_ms - now_ms) / 1000:.3f} s in the future; "
            f"accepted clock skew: {policy.max_skew_s} s"
        )
    if now_ms > claims.expires_at_ms + skew_ms:
        raise TokenExpired(
            f"token expired {(now_ms - claims.expires_at_ms) / 1000:.3f} s ago; accepted clock "
            f"skew: {policy.max_skew_s} s; ask the broker for a new placement"
        )
    lifetime = claims.expires_at_ms - claims.issued_at_ms
    if not 0 < lifetime <= policy.max_ttl_s * 1000:
        raise TokenLifetimeTooLong(
            f"token lifetime {lifetime / 1000:.3f} s; policy v{policy.version} accepts "
            f"0 < lifetime <= {policy.max_ttl_s} s"
        )
