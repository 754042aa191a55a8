"""Ed25519 keys: the ``ed25519:<base64url>`` text form used in policy files, PEM files for
private keys, fingerprints, signatures and their checks.

This module owns every call into ``cryptography``'s Ed25519 API (key files, certificates'
keys) and into libsodium's (PyNaCl), which makes and checks the signatures: on the nodes'
hot paths (placement tokens, usage records and their countersignatures) it checks one in
half the time OpenSSL takes and signs in two thirds (``docs/performance.md``). Ed25519
signatures are deterministic, so both make the same bytes. It never creates a key on its
own initiative and never writes a private key anywhere the caller did not name; there is no
default key anywhere in ``policies``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import nacl.bindings
import nacl.exceptions
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from policies.errors import KeyFileError

KEY_PREFIX = "ed25519:"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
FINGERPRINT_BYTES = 8


def b64u_encode(data: bytes) -> str:
    """base64url without padding."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64u_decode(text: str) -> bytes:
    """Strict base64url (padding optional); raises ``ValueError`` on any other character."""
    if not text.isascii():
        raise ValueError("not base64url: only A-Z a-z 0-9 - _ are accepted")
    std = text.rstrip("=").replace("-", "+").replace("_", "/")
    if "+" in text or "/" in text:
        raise ValueError("not base64url: '+' and '/' are not accepted, use '-' and '_'")
    std += "=" * (-len(std) % 4)
    try:
        return binascii.a2b_base64(std.encode("ascii"), strict_mode=True)
    except binascii.Error as exc:
        raise ValueError(f"not base64url ({exc})") from exc


def public_key_text(raw: bytes) -> str:
    """The text form of a raw 32-byte public key, as written in policy files."""
    return KEY_PREFIX + b64u_encode(raw)


def decode_public_key(text: str) -> bytes:
    """Raw key bytes from ``ed25519:<43 base64url chars>``; ``ValueError`` names what is wrong."""
    if not text.startswith(KEY_PREFIX):
        raise ValueError(f"key {text[:24]!r} must start with {KEY_PREFIX!r}")
    raw = b64u_decode(text[len(KEY_PREFIX) :])
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key has 32 bytes, this one has {len(raw)}")
    return raw


def parse_public_key(text: str) -> bytes:
    """Like ``decode_public_key`` but raises ``KeyFileError`` (for command-line input)."""
    try:
        return decode_public_key(text.strip())
    except ValueError as exc:
        raise KeyFileError(f"bad public key: {exc}") from exc


def fingerprint(raw: bytes) -> bytes:
    """First 8 bytes of sha256(raw public key): a lookup hint, never a trust decision."""
    return hashlib.sha256(raw).digest()[:FINGERPRINT_BYTES]


def signature_valid(public: bytes, signature: bytes, message: bytes) -> bool:
    """True if ``signature`` is ``public``'s Ed25519 signature of ``message``; a ``public``
    that is not 32 bytes is a ``ValueError`` (the caller's mistake, not a forgery)."""
    if len(public) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key has 32 bytes, this one has {len(public)}")
    if len(signature) != SIGNATURE_BYTES:
        return False
    try:
        nacl.bindings.crypto_sign_open(signature + message, public)
    except nacl.exceptions.BadSignatureError:
        return False
    return True


@dataclass(frozen=True)
class SigningKey:
    """A private key with its raw public key and fingerprint computed once."""

    private: Ed25519PrivateKey
    public: bytes
    fingerprint: bytes
    secret: bytes = field(repr=False)  # libsodium's form: the seed, then the public key

    @classmethod
    def from_private(cls, private: Ed25519PrivateKey) -> SigningKey:
        seed = private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        public, secret = nacl.bindings.crypto_sign_seed_keypair(seed)
        return cls(private=private, public=public, fingerprint=fingerprint(public), secret=secret)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls.from_private(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> SigningKey:
        """A key from a 32-byte seed: for deterministic test fixtures only."""
        return cls.from_private(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public_text(self) -> str:
        return public_key_text(self.public)

    def sign(self, message: bytes) -> bytes:
        return nacl.bindings.crypto_sign(message, self.secret)[:SIGNATURE_BYTES]

    def to_pem(self) -> bytes:
        return self.private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def signing_key_from_pem(data: bytes, *, source: str) -> SigningKey:
    """Parse an unencrypted PKCS#8 PEM Ed25519 private key."""
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(
            f"{source}: not an unencrypted PKCS#8 PEM private key "
            f"(as written by 'sluicegate policy keygen'): {exc}"
        ) from exc
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyFileError(f"{source}: holds a {type(private).__name__}; expected an Ed25519 key")
    return SigningKey.from_private(private)


def load_signing_key(path: Path) -> SigningKey:
    """Read a private key file written by ``write_key_pair``."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read key file: {exc.strerror}") from exc
    return signing_key_from_pem(data, source=str(path))


def public_key_of(path: Path | None) -> bytes | None:
    """The public half of the key in ``path``, or None when there is none to read (a check
    that compares it then has nothing to compare)."""
    if path is None:
        return None
    try:
        return load_signing_key(path).public
    except KeyFileError:
        return None


def write_key_pair(directory: Path, name: str) -> tuple[Path, Path, SigningKey]:
    """Create ``name.key`` (PEM, mode 0600) and ``name.pub`` in ``directory``; never overwrite.

    A missing ``directory`` (and any missing parent) is created with mode 0700, since it holds
    a private key; one that exists keeps the permissions it has."""
    key = SigningKey.generate()
    key_path = directory / f"{name}.key"
    pub_path = directory / f"{name}.pub"
    for path in (key_path, pub_path):
        if path.exists():
            raise KeyFileError(f"{path} exists; refusing to overwrite a key, pick another name")
    try:
        for level in (*reversed(directory.parents), directory):
            if not level.is_dir():
                level.mkdir(mode=0o700)
    except OSError as exc:
        raise KeyFileError(
            f"cannot create the key directory {directory}: {exc.filename}: {exc.strerror}"
        ) from exc
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key.to_pem())
    pub_path.write_text(key.public_text + "\n", encoding="ascii")
    return key_path, pub_path, key
