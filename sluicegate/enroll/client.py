"""The new node's side of enrollment: make the key here, prove the token, keep the answer
only if it matches what the token pins.

:func:`enroll` writes into the node's state directory: ``node.key`` (made here, 0600, it
never leaves), ``node.pem`` (its certificate), ``ca.pem`` (the campus CA, whose fingerprint
the token names) and the pinned policy (the anchor and envelope files the node's policy feed
reads, so it trusts no policy from the network on first use). The answer is checked before
anything is kept: the CA must be the one the token pins, the certificate must be that CA's,
for this node and this key, and the policy must be signed by the officers the token pins.
A node already enrolled under the token's id with a valid certificate is left as it is.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from pydantic import ValidationError

from policies import SigningKey, load_signing_key, open_envelope
from policies.errors import PolicyError
from policies.signing import dump_anchor
from sluicegate import pki
from sluicegate.enroll.authority import EnrollAnswer, EnrollRequest
from sluicegate.enroll.token import JoinClaims, anchor_fingerprint, parse_token, proof
from sluicegate.errors import EnrollmentRefused, IdentityError
from sluicegate.files import write_atomic
from sluicegate.policy_feed import ANCHOR_FILE, ENVELOPE_FILE

KEY, CERT, CA = "node.key", "node.pem", "ca.pem"
RECORD = "enrollment.json"  # where it enrolled: what 'sluicegate doctor' checks against
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Enrolled:
    """Who the node now is, and where its campus's Mosquitto is."""

    node: str
    role: str
    zone: str
    mqtt_host: str
    mqtt_port: int
    key: str  # its public key, as the policy lists it
    fresh: bool  # False: it was enrolled already; nothing was asked


def mqtt_address(claims: JoinClaims) -> tuple[str, int]:
    host, _, port = claims.mqtt.rpartition(":")
    if not host or not port.isdigit():
        raise EnrollmentRefused("join.malformed", f"the token's MQTT address {claims.mqtt!r}")
    return host, int(port)


def _already(state: Path, claims: JoinClaims, now: float) -> Enrolled | None:
    try:
        cert = pki.read_cert(state / CERT)
        ca = pki.read_cert(state / CA)
        key = load_signing_key(state / KEY)
        pki.check_issued(cert, ca, now=now)
    except (IdentityError, PolicyError):
        return None
    if pki.common_name(cert) != claims.node or pki.cert_fingerprint(ca) != claims.ca:
        return None
    host, port = mqtt_address(claims)
    return Enrolled(claims.node, claims.role, claims.zone, host, port, key.public_text, False)


def _post(url: str, body: bytes) -> bytes:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return bytes(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            doc = json.loads(detail)
            code, why = str(doc.get("code", "join.refused")), str(doc.get("error"))
        except (ValueError, AttributeError):
            code, why = "join.refused", f"{url} answered {exc.code}: {detail[:300]}"
        raise EnrollmentRefused(code, why) from None
    except OSError as exc:
        raise IdentityError(f"cannot reach the enrollment endpoint {url}: {exc}") from exc


def _check_answer(
    answer: EnrollAnswer, claims: JoinClaims, key: SigningKey, now: float
) -> tuple[x509.Certificate, x509.Certificate, bytes]:
    try:
        ca = x509.load_pem_x509_certificate(answer.ca.encode())
        cert = x509.load_pem_x509_certificate(answer.certificate.encode())
        envelope = base64.b64decode(answer.policy_envelope, validate=True)
    except ValueError as exc:
        raise IdentityError(f"the enrollment answer is malformed: {exc}") from exc
    if pki.cert_fingerprint(ca) != claims.ca:
        raise IdentityError(
            f"the enrollment endpoint sent CA {pki.cert_fingerprint(ca)}, but the join token "
            f"pins {claims.ca}: not this campus's authority; nothing was kept"
        )
    pki.check_issued(cert, ca, now=now)
    public = cert.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    if pki.common_name(cert) != claims.node or public != key.public:
        raise IdentityError("the certificate sent back is not for this node's key")
    return ca, cert, envelope


def enroll(token: str, state: Path, *, role: str, now: float) -> Enrolled:
    """Enroll this node with ``token`` into its state directory ``state``."""
    claims, secret = parse_token(token)
    # Expiry and scope are the authority's to judge (and audit), not checked here first.
    done = _already(state, claims, now) if claims.role == role else None
    if done is not None:
        return done
    state.mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate()  # made here; it never leaves this machine
    csr = pki.certificate_request(key.private, claims.node)
    der = csr.public_bytes(serialization.Encoding.DER)
    request = EnrollRequest(
        claims=claims,
        csr=csr.public_bytes(serialization.Encoding.PEM).decode(),
        proof=proof(secret, der),
        role=role,
    )
    raw = _post(claims.url, request.model_dump_json().encode())
    try:
        answer = EnrollAnswer.model_validate_json(raw)
    except ValidationError as exc:
        raise IdentityError(f"the enrollment answer is malformed: {exc}") from exc
    ca, cert, envelope = _check_answer(answer, claims, key, now)
    try:
        policy, anchor = open_envelope(envelope, now=now, anchor=None, source=claims.url)
    except PolicyError as exc:
        raise IdentityError(f"the policy the enrollment endpoint sent is not valid: {exc}") from exc
    if anchor_fingerprint(anchor) != claims.anchor:
        raise IdentityError(
            f"the policy v{policy.version} the enrollment endpoint sent is signed by other "
            "officers (or another threshold) than the join token pins; nothing was kept"
        )
    pki.write_private(state / KEY, key.to_pem())
    (state / CERT).write_bytes(pki.cert_pem(cert))
    (state / CA).write_bytes(pki.cert_pem(ca))
    write_atomic(state / ENVELOPE_FILE, envelope)
    write_atomic(state / ANCHOR_FILE, dump_anchor(anchor))
    record = {
        "node": claims.node,
        "role": role,
        "zone": claims.zone,
        "enroll_url": claims.url,
        "broker_url": claims.url.removesuffix("/v1/enroll"),
        "mqtt": claims.mqtt,
        "token": claims.id,
        "enrolled_at": round(now, 3),
    }
    write_atomic(state / RECORD, json.dumps(record, indent=1).encode())
    host, port = mqtt_address(claims)
    return Enrolled(claims.node, role, claims.zone, host, port, answer.key, True)
