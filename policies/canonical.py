"""The canonical serialisation of a policy, and its digest.

The same policy always has the same bytes, whatever the file's layout, key order, comments or
number spelling: the validated document is dumped as JSON with sorted keys, no whitespace,
ASCII only (``\\uXXXX`` escapes) and Python's shortest round-trip float repr. Those bytes are
what signers sign (through their sha256 digest) and what the broker publishes. This module
must never depend on the source text: only on the validated document.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from policies.schema import PolicyDocument

DIGEST_BYTES = 32


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON bytes for plain JSON values (dict, list, str, int, float, bool)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def canonical_bytes(doc: PolicyDocument) -> bytes:
    """The canonical form of a validated policy document. A policy without a ``[rollout]``
    table has no ``rollout`` key at all, and one without ``min_burst`` or ``max_drop_points``
    no such key in it,
    so policies written before them keep their digests; likewise a pool's empty
    ``encryption_keys``, a class's ``confidential = false`` and an empty ``[peers]``."""
    data = doc.model_dump(mode="json")
    if doc.rollout is None:
        del data["rollout"]
    else:
        for key in ("min_burst", "max_drop_points"):
            if getattr(doc.rollout, key) is None:
                del data["rollout"][key]
    for pool in data["pools"].values():
        if not pool["encryption_keys"]:
            del pool["encryption_keys"]
    for cls in data["classes"].values():
        if not cls["confidential"]:
            del cls["confidential"]
    if not doc.peers:
        del data["peers"]
    return canonical_json(data)


def digest(canonical: bytes) -> bytes:
    """sha256 of the canonical bytes: the policy's identity."""
    return hashlib.sha256(canonical).digest()


def digest_text(value: bytes) -> str:
    return "sha256:" + value.hex()
