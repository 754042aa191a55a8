"""The enrollment authority: the campus CA's folder, and what it decides about a request.

The folder (``sluicegate ca init``) holds the CA key and certificate and the authority's
token key (``enroll.key``), all 0600, and ``enrollments.jsonl``, one line per node enrolled
(id, role, zone, its key, the certificate's serial, when): what a compliance officer adds to
the policy (``sluicegate enroll list`` prints each with the ``policy add-node`` line to
run). The broker replica that holds the folder serves enrollment over its HTTP API; it
checks single use in Redis and audits every issue and refusal.

:meth:`Authority.decide` is pure (the clock passed in); :meth:`Authority.record` appends to
the registry. The request and answer documents are the pydantic models here.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from pydantic import BaseModel, ConfigDict, Field

from policies.keys import SigningKey, public_key_text
from sluicegate import pki
from sluicegate.enroll.token import JoinClaims, check_request
from sluicegate.errors import EnrollmentRefused, IdentityError

TOKEN_KEY = "enroll.key"
REGISTRY = "enrollments.jsonl"


class EnrollRequest(BaseModel):
    """New node → authority (``POST /v1/enroll``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    claims: JoinClaims
    csr: str = Field(max_length=8192)  # PEM
    proof: str = Field(max_length=100)
    role: str = Field(max_length=16)


class EnrollAnswer(BaseModel):
    """Authority → new node: its certificate, the CA's, and the policy to pin."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str
    role: str
    zone: str
    certificate: str  # PEM
    ca: str  # PEM
    policy_envelope: str  # base64 of the signed policy envelope in force
    key: str  # the node's public key as the policy lists keys (ed25519:…)


@dataclass(frozen=True)
class Issued:
    claims: JoinClaims
    cert: x509.Certificate
    key_text: str

    def record(self) -> dict[str, str]:
        """Who was enrolled: what the registry and the audit log keep."""
        claims = self.claims
        return {
            "node": claims.node,
            "role": claims.role,
            "zone": claims.zone,
            "key": self.key_text,
            "serial": format(self.cert.serial_number, "x"),
            "token": claims.id,
        }


def init_folder(folder: Path, campus: str, *, now: float) -> pki.Authority:
    """A new campus CA and token key in ``folder`` (refused if one is there)."""
    if (folder / pki.CA_KEY).exists():
        raise IdentityError(f"{folder} already holds a campus CA; it is never overwritten")
    ca = pki.new_authority(campus, now=now)
    pki.save_authority(ca, folder)
    pki.write_private(folder / TOKEN_KEY, secrets.token_bytes(32))
    os.chmod(folder, 0o700)
    return ca


class Authority:
    """A loaded CA folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ca = pki.load_authority(folder)
        try:
            self.token_key = (folder / TOKEN_KEY).read_bytes()
        except OSError as exc:
            raise IdentityError(f"{folder}: cannot read {TOKEN_KEY}: {exc.strerror}") from exc
        if len(self.token_key) != 32:
            raise IdentityError(f"{folder / TOKEN_KEY} is not a token key (32 bytes)")

    @property
    def ca_fingerprint(self) -> str:
        return self.ca.fingerprint

    def decide(self, request: EnrollRequest, *, now: float, days: int = pki.NODE_DAYS) -> Issued:
        """Check ``request`` (proof, expiry, scope, the CSR) and issue its certificate;
        EnrollmentRefused saying why not. Single use is the caller's (shared state)."""
        try:
            csr = x509.load_pem_x509_csr(request.csr.encode())
        except ValueError as exc:
            raise EnrollmentRefused(
                "join.malformed", f"not a PEM certificate request: {exc}"
            ) from None
        der = csr.public_bytes(serialization.Encoding.DER)
        node = pki.common_name(csr)
        check_request(
            self.token_key,
            request.claims,
            der,
            request.proof,
            node=node,
            role=request.role,
            now=now,
        )
        try:
            pki.check_request(csr, node)
        except IdentityError as exc:
            raise EnrollmentRefused("join.malformed", str(exc)) from None
        public = csr.public_key()
        if not isinstance(public, ed25519.Ed25519PublicKey):
            raise EnrollmentRefused(
                "join.malformed",
                "a node's key is Ed25519 (its policy entry and audit signatures use it); "
                "the request carries another kind",
            )
        cert = pki.issue(self.ca, public, node, purpose="client", now=now, days=days)
        raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return Issued(request.claims, cert, public_key_text(raw))

    def answer(self, issued: Issued, policy_envelope: bytes) -> EnrollAnswer:
        claims = issued.claims
        return EnrollAnswer(
            node=claims.node,
            role=claims.role,
            zone=claims.zone,
            certificate=pki.cert_pem(issued.cert).decode(),
            ca=pki.cert_pem(self.ca.cert).decode(),
            policy_envelope=base64.b64encode(policy_envelope).decode(),
            key=issued.key_text,
        )

    def record(self, issued: Issued, *, now: float | None = None) -> None:
        """Append the enrolled node to the registry the officers read."""
        self._append(dict(issued.record()), now)

    def record_issued_here(
        self, node: str, role: str, cert: x509.Certificate, key_text: str, *, now: float
    ) -> None:
        """Append a node whose key was made on this machine (``ca issue``: the first
        broker replica, an observer) to the same registry; it has no zone and no token."""
        serial = format(cert.serial_number, "x")
        self._append(
            {
                "node": node,
                "role": role,
                "zone": "",
                "key": key_text,
                "serial": serial,
                "token": "",
            },
            now,
        )

    def issue_here(self, node: str, role: str, state_dir: Path, *, now: float) -> str:
        """A key made on this machine and its certificate for ``node`` (``ca issue``):
        ``node.key``, ``node.pem`` and ``ca.pem`` in ``state_dir``, the node in the
        registry; its public key text."""
        key = SigningKey.generate()
        cert = pki.issue(
            self.ca, key.private.public_key(), node, purpose="client", now=now, days=365
        )
        pki.write_private(state_dir / "node.key", key.to_pem())
        (state_dir / "node.pem").write_bytes(pki.cert_pem(cert))
        (state_dir / "ca.pem").write_bytes(pki.cert_pem(self.ca.cert))
        self.record_issued_here(node, role, cert, key.public_text, now=now)
        return key.public_text

    def _append(self, line: dict[str, object], now: float | None) -> None:
        line["at"] = round(now if now is not None else time.time(), 3)
        with (self.folder / REGISTRY).open("a") as handle:
            handle.write(json.dumps(line, sort_keys=True) + "\n")

    def enrolled(self) -> list[dict[str, object]]:
        """Every node enrolled so far, oldest first (a node enrolled twice: twice)."""
        path = self.folder / REGISTRY
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
