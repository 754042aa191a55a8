"""The campus certificate authority: X.509 certificates for Mosquitto and every node.

Why client certificates rather than a password file (docs/deployment.md): the node's private
key is made on the node and never leaves it (only a certificate request does), Mosquitto
holds no secret per node, a certificate expires by itself, and the same CA lets each node
check that it talks to the plant's Mosquitto. A node's certificate carries its Ed25519
identity key, the one its policy entry lists, so one key proves the node to the transport
(TLS 1.3 client authentication) and signs its audit records; the CN is its node id, which
Mosquitto takes as its username and client id. The CA and the server certificate use ECDSA
P-256, which every MQTT client library verifies.

Pure functions over ``cryptography`` objects with the clock passed in, plus PEM reading and
writing; errors become :class:`~sluicegate.errors.IdentityError` naming the file and what is
wrong. It keeps no state and opens no connection.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sluicegate.errors import IdentityError
from sluicegate.files import write_atomic

CA_DAYS = 3650
SERVER_DAYS = 825
NODE_DAYS = 365
BACKDATE = dt.timedelta(minutes=5)  # tolerate clocks a little behind the CA's

CaKey = ec.EllipticCurvePrivateKey
NodeKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
Purpose = Literal["server", "client"]


@dataclass(frozen=True)
class Authority:
    """A CA key and its self-signed certificate."""

    key: CaKey
    cert: x509.Certificate

    @property
    def fingerprint(self) -> str:
        return cert_fingerprint(self.cert)


def _name(common_name: str, organisation: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organisation:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation))
    return x509.Name(attrs)


def _utc(now: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(now, dt.UTC)


def cert_fingerprint(cert: x509.Certificate) -> str:
    """``sha256:<hex>`` of the certificate's DER bytes (what a join token pins)."""
    return "sha256:" + cert.fingerprint(hashes.SHA256()).hex()


def common_name(cert: x509.Certificate | x509.CertificateSigningRequest) -> str:
    values = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(values[0].value) if values else ""


def new_authority(campus: str, *, now: float, days: int = CA_DAYS) -> Authority:
    """A fresh campus CA (ECDSA P-256), valid for ``days``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"Sluicegate campus CA {campus}", campus)
    start = _utc(now) - BACKDATE
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return Authority(key, cert)


def _alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for host in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            out.append(x509.DNSName(host))
    return out


def issue(
    ca: Authority,
    public_key: ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey,
    subject: str,
    *,
    purpose: Purpose,
    now: float,
    days: int,
    hosts: Sequence[str] = (),
) -> x509.Certificate:
    """A leaf certificate for ``subject``: a server (with ``hosts`` as its SANs) or a client
    (``subject`` is its node id)."""
    if purpose == "server" and not hosts:
        raise IdentityError("a server certificate needs at least one host name or address")
    start = _utc(now) - BACKDATE
    usage = (
        ExtendedKeyUsageOID.SERVER_AUTH if purpose == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
    )
    org = ca.cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject, str(org[0].value) if org else None))
        .issuer_name(ca.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(min(start + dt.timedelta(days=days), ca.cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), False
        )
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName(_alt_names(hosts)), False)
    return builder.sign(ca.key, hashes.SHA256())


def server_identity(
    ca: Authority, hosts: Sequence[str], *, now: float, days: int = SERVER_DAYS
) -> tuple[CaKey, x509.Certificate]:
    """A fresh ECDSA key and a server certificate for ``hosts`` (Mosquitto's, the enrollment
    endpoint's)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = issue(ca, key.public_key(), hosts[0], purpose="server", now=now, days=days, hosts=hosts)
    return key, cert


def certificate_request(key: NodeKey, node_id: str) -> x509.CertificateSigningRequest:
    """A CSR for ``node_id`` signed by the node's own key (Ed25519 signs without a hash)."""
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return x509.CertificateSigningRequestBuilder().subject_name(_name(node_id)).sign(key, algorithm)


def check_request(csr: x509.CertificateSigningRequest, node_id: str) -> None:
    """The CSR is signed by the key it carries and names ``node_id``; else IdentityError."""
    if not csr.is_signature_valid:
        raise IdentityError("the certificate request's signature does not verify")
    if common_name(csr) != node_id:
        raise IdentityError(
            f"the certificate request names {common_name(csr)!r}; this enrollment is for "
            f"{node_id!r}"
        )
    if not isinstance(csr.public_key(), ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey):
        raise IdentityError("the certificate request's key is neither Ed25519 nor ECDSA")


def check_issued(cert: x509.Certificate, ca: x509.Certificate, *, now: float) -> None:
    """``cert`` was signed by ``ca`` and is valid at ``now``; else IdentityError saying
    which."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise IdentityError(
            f"certificate {common_name(cert)!r} was not issued by CA {common_name(ca)!r}"
        ) from exc
    moment = _utc(now)
    if moment < cert.not_valid_before_utc:
        raise IdentityError(
            f"certificate {common_name(cert)!r} is not valid before "
            f"{cert.not_valid_before_utc:%Y-%m-%dT%H:%M:%SZ} (is this clock behind?)"
        )
    if moment >= cert.not_valid_after_utc:
        raise IdentityError(
            f"certificate {common_name(cert)!r} expired at "
            f"{cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"
        )


def names_host(cert: x509.Certificate, host: str) -> bool:
    """Whether ``cert``'s SANs cover ``host`` (an address or a DNS name, no wildcards)."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    try:
        return ipaddress.ip_address(host) in sans.get_values_for_type(x509.IPAddress)
    except ValueError:
        return host.lower() in (n.lower() for n in sans.get_values_for_type(x509.DNSName))


def days_left(cert: x509.Certificate, *, now: float) -> float:
    return (cert.not_valid_after_utc - _utc(now)).total_seconds() / 86400.0


# -- PEM files ---------------------------------------------------------------------------


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: NodeKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner may read (a key), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, mode=0o600)


def read_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        raise IdentityError(f"{path}: cannot read certificate: {exc.strerror}") from exc
    except ValueError as exc:
        raise IdentityError(f"{path}: not a PEM certificate ({exc})") from exc


def read_ca_key(path: Path) -> CaKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise IdentityError(f"{path}: cannot read the CA key: {exc.strerror}") from exc
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"{path}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise IdentityError(f"{path}: the campus CA key must be ECDSA, got {type(key).__name__}")
    return key


CA_CERT, CA_KEY = "ca.pem", "ca.key"


def save_authority(ca: Authority, folder: Path) -> None:
    """``ca.pem`` (give it to everyone) and ``ca.key`` (0600; it never leaves this folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_private(folder / CA_KEY, key_pem(ca.key))
    (folder / CA_CERT).write_bytes(cert_pem(ca.cert))


def load_authority(folder: Path) -> Authority:
    ca = Authority(read_ca_key(folder / CA_KEY), read_cert(folder / CA_CERT))
    public = ca.cert.public_key()
    if (
        not isinstance(public, ec.EllipticCurvePublicKey)
        or public.public_numbers() != ca.key.public_key().public_numbers()
    ):
        raise IdentityError(f"{folder}: {CA_KEY} is not the key of {CA_CERT}")
    return ca
