"""Images sealed to the chosen worker: HPKE (RFC 9180) keys, their text form, and the
seal and open of one work message.

A worker holds one or more X25519 key pairs; the policy lists their public keys in the
worker's pool entry (``encryption_keys``), and a placement token binds the id of the one the
edge must seal to (``PlacementClaims.seal_key_id``). The suite is fixed: DHKEM(X25519,
HKDF-SHA256), HKDF-SHA256, AES-128-GCM, base mode. The HPKE ``info`` binds the token's nonce
(its id), the key id, the job id, the data class and the origin and target zones and worker
(:func:`work_info`), so a ciphertext opens only with the token it was sealed for: a token
moved onto another job's ciphertext fails to open.

This module owns every call into ``cryptography``'s X25519 and HPKE APIs. It creates a key
only when asked (:meth:`SealingKey.generate`) and never writes one anywhere the caller did
not name.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hpke, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from policies.errors import KeyFileError, SealOpenFailed
from policies.keys import b64u_decode, b64u_encode

SEAL_KEY_PREFIX = "x25519:"
SEAL_PUBLIC_BYTES = 32
SEAL_KEY_ID_BYTES = 8
NO_KEY = bytes(SEAL_KEY_ID_BYTES)  # what a token binds when the image travels in the clear
SEAL_OVERHEAD = 32 + 16  # the encapsulated key and the AES-GCM tag
INFO_DOMAIN = b"sluicegate-work/1\n"
SUITE_NAME = "DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM"
_SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_128_GCM)


def seal_key_text(raw: bytes) -> str:
    """The text form of a raw X25519 public key, as written in policy files."""
    return SEAL_KEY_PREFIX + b64u_encode(raw)


def decode_seal_key(text: str) -> bytes:
    """Raw key bytes from ``x25519:<43 base64url chars>``; ``ValueError`` names the problem."""
    if not text.startswith(SEAL_KEY_PREFIX):
        raise ValueError(f"encryption key {text[:24]!r} must start with {SEAL_KEY_PREFIX!r}")
    raw = b64u_decode(text[len(SEAL_KEY_PREFIX) :])
    if len(raw) != SEAL_PUBLIC_BYTES:
        raise ValueError(f"an X25519 public key has 32 bytes, this one has {len(raw)}")
    if raw == bytes(SEAL_PUBLIC_BYTES):
        raise ValueError("the all-zero X25519 key is not a key")
    return raw


def seal_key_id(raw: bytes) -> bytes:
    """First 8 bytes of sha256 over the domain and the raw public key: what a token binds."""
    return hashlib.sha256(b"sluicegate-seal-key/1\n" + raw).digest()[:SEAL_KEY_ID_BYTES]


@dataclass(frozen=True)
class SealingKey:
    """A worker's private X25519 key with its public key and id computed once."""

    private: X25519PrivateKey
    public: bytes
    key_id: bytes

    @classmethod
    def from_private(cls, private: X25519PrivateKey) -> SealingKey:
        public = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return cls(private=private, public=public, key_id=seal_key_id(public))

    @classmethod
    def generate(cls) -> SealingKey:
        return cls.from_private(X25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> SealingKey:
        """A key from 32 bytes: for deterministic test fixtures only."""
        return cls.from_private(X25519PrivateKey.from_private_bytes(seed))

    @property
    def public_text(self) -> str:
        return seal_key_text(self.public)

    def to_pem(self) -> bytes:
        return self.private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def sealing_key_from_pem(data: bytes, *, source: str) -> SealingKey:
    """Parse an unencrypted PKCS#8 PEM X25519 private key."""
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{source}: not an unencrypted PKCS#8 PEM private key: {exc}") from exc
    if not isinstance(private, X25519PrivateKey):
        raise KeyFileError(f"{source}: holds a {type(private).__name__}; expected an X25519 key")
    return SealingKey.from_private(private)


def load_sealing_key(path: Path) -> SealingKey:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read key file: {exc.strerror}") from exc
    return sealing_key_from_pem(data, source=str(path))


def _field(text: str) -> bytes:
    raw = text.encode("utf-8")
    return len(raw).to_bytes(2, "big") + raw


def work_info(
    *,
    token_id: bytes,
    key_id: bytes,
    job_id: str,
    data_class: str,
    origin_zone: str,
    target_worker: str,
    target_zone: str,
) -> bytes:
    """The HPKE info of one placement's work message: every field length-prefixed, so no
    two placements share an info."""
    return b"".join(
        (
            INFO_DOMAIN,
            _field(token_id.hex()),
            _field(key_id.hex()),
            *(_field(t) for t in (job_id, data_class, origin_zone, target_worker, target_zone)),
        )
    )


_PUBLIC_CACHE: dict[bytes, X25519PublicKey] = {}


def seal(public: bytes, plaintext: bytes, info: bytes) -> bytes:
    """Encrypt ``plaintext`` to ``public`` (raw X25519): the encapsulated key, then the
    AES-128-GCM ciphertext and tag; 48 bytes longer than ``plaintext``."""
    key = _PUBLIC_CACHE.get(public)
    if key is None:
        if len(_PUBLIC_CACHE) > 4096:
            _PUBLIC_CACHE.clear()
        key = _PUBLIC_CACHE[public] = X25519PublicKey.from_public_bytes(public)
    return _SUITE.encrypt(plaintext, key, info=info)


def open_sealed(key: SealingKey, sealed: bytes, info: bytes) -> bytes:
    """The plaintext of ``sealed``, or ``SealOpenFailed``: another key, another placement's
    info, or bytes changed on the way all read the same (AES-GCM's tag does not verify)."""
    if len(sealed) < SEAL_OVERHEAD:
        raise SealOpenFailed(
            f"the sealed payload has {len(sealed)} bytes, fewer than the {SEAL_OVERHEAD} "
            "bytes of an encapsulated key and tag"
        )
    try:
        return _SUITE.decrypt(sealed, key.private, info=info)
    except (InvalidTag, ValueError) as exc:
        raise SealOpenFailed(
            f"the sealed payload does not open with key {key.key_id.hex()} for this placement: "
            "it was sealed for another placement or key, or altered on the way"
        ) from exc
