"""Join tokens: what the operator hands a new node, and how a request proves it holds one.

A token is its claims (node id, role, zone, expiry, a random id, where to enroll and which
MQTT broker to use, and the fingerprints the node must pin: the campus CA's certificate
and the policy's trust anchor) plus a secret derived from them with the authority's key,
``HMAC(authority key, claims)``. The node never sends that secret: it signs its certificate
request with it (``proof``), so a token read off the wire, or a request replayed with
another key, proves nothing; changing any claim changes the secret the authority expects.
The authority keeps no list of tokens, only of those used (single use, in Redis).

Pure: no I/O, the clock passed in. Each refusal is an :class:`EnrollmentRefused` with a
stable code (``join.malformed``, ``join.expired``, ``join.bad_proof``, ``join.wrong_scope``,
``join.reused`` is the authority's) and a sentence saying what to do.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies.signing import TrustAnchor
from sluicegate.errors import EnrollmentRefused

PREFIX = "sgjoin1."
MAX_TTL_S = 7 * 86400
Role = Literal["edge", "pool", "broker", "app"]
NODE_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class JoinClaims(BaseModel):
    """What a join token says; everything in it is covered by its secret."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    node: str = Field(pattern=NODE_ID)
    role: Role
    zone: str = Field(min_length=1, max_length=64)
    exp: int  # unix seconds
    url: str = Field(min_length=1, max_length=300)  # the enrollment endpoint
    mqtt: str = Field(min_length=1, max_length=300)  # host:port of the campus's Mosquitto
    ca: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")  # the campus CA certificate's
    anchor: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")  # the policy's trust anchor's

    def canonical(self) -> bytes:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":")).encode()


def new_token_id() -> str:
    return secrets.token_hex(16)


def anchor_fingerprint(anchor: TrustAnchor) -> str:
    """What a token pins of a policy: who signs it and how many must (not its version,
    which moves on)."""
    digest = hashlib.sha256(b"sluicegate-anchor/1")
    digest.update(anchor.threshold.to_bytes(2, "big"))
    for key in sorted(anchor.signer_keys):
        digest.update(key)
    return "sha256:" + digest.hexdigest()


def token_secret(authority_key: bytes, claims: JoinClaims) -> bytes:
    return hmac.new(authority_key, b"sluicegate-join/1" + claims.canonical(), "sha256").digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def make_token(authority_key: bytes, claims: JoinClaims) -> str:
    """The token text an operator copies to the new node."""
    secret = token_secret(authority_key, claims)
    return PREFIX + _b64(claims.canonical()) + "." + _b64(secret)


def parse_token(text: str) -> tuple[JoinClaims, bytes]:
    """The claims and secret of a token; ``join.malformed`` if it is not one."""
    body = text.strip()
    if not body.startswith(PREFIX):
        raise EnrollmentRefused(
            "join.malformed",
            f"not a join token (it should start with {PREFIX!r}); make one with "
            "'sluicegate enroll token'",
        )
    try:
        claims_part, secret_part = body[len(PREFIX) :].split(".")
        claims = JoinClaims.model_validate_json(_unb64(claims_part))
        secret = _unb64(secret_part)
    except (ValueError, ValidationError) as exc:
        raise EnrollmentRefused(
            "join.malformed", f"the join token is damaged (copied incompletely?): {exc}"
        ) from None
    if len(secret) != 32:
        raise EnrollmentRefused("join.malformed", "the join token's secret is damaged")
    return claims, secret


def proof(secret: bytes, request: bytes) -> str:
    """What a node sends to show it holds the token: its secret's MAC over the request."""
    return _b64(hmac.new(secret, b"sluicegate-join-proof/1" + request, "sha256").digest())


def check_fresh(claims: JoinClaims, *, now: float) -> None:
    if now >= claims.exp:
        raise EnrollmentRefused(
            "join.expired",
            f"join token {claims.id[:8]} for {claims.role} {claims.node!r} expired "
            f"{now - claims.exp:.0f} s ago; ask the operator for a new one "
            "('sluicegate enroll token')",
        )


def check_request(
    authority_key: bytes,
    claims: JoinClaims,
    request: bytes,
    sent_proof: str,
    *,
    node: str,
    role: str,
    now: float,
) -> None:
    """An enrollment request (``request``: the certificate request's bytes) for ``node``
    as ``role`` is covered by a token the authority made, unexpired and for that node."""
    expected = proof(token_secret(authority_key, claims), request)
    if not hmac.compare_digest(expected, sent_proof):
        raise EnrollmentRefused(
            "join.bad_proof",
            "the request does not prove it holds a join token this campus made (the token "
            "was altered, made by another campus, or the request was tampered with)",
        )
    check_fresh(claims, now=now)
    if (node, role) != (claims.node, claims.role):
        raise EnrollmentRefused(
            "join.wrong_scope",
            f"the join token is for {claims.role} {claims.node!r} in zone {claims.zone!r}; "
            f"it cannot enroll {role} {node!r}",
        )


def claims_for(
    *,
    node: str,
    role: Role,
    zone: str,
    ttl_s: float,
    now: float,
    url: str,
    mqtt: str,
    ca: str,
    anchor: str,
) -> JoinClaims:
    if not 0 < ttl_s <= MAX_TTL_S:
        raise EnrollmentRefused(
            "join.malformed", f"a join token lives 1 s to {MAX_TTL_S // 86400} days, not {ttl_s} s"
        )
    try:
        return JoinClaims(
            id=new_token_id(),
            node=node,
            role=role,
            zone=zone,
            exp=int(now + ttl_s),
            url=url,
            mqtt=mqtt,
            ca=ca,
            anchor=anchor,
        )
    except ValidationError as exc:
        raise EnrollmentRefused("join.malformed", f"cannot make that token: {exc}") from None
