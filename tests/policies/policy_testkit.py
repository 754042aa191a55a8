"""Deterministic test keys and policy builders shared by the policy tests.

The private keys here are derived from public names, so they are PUBLISHED: anything they sign
proves nothing. ``policies.check`` warns when one of them appears in a policy.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from policies.keys import SigningKey
from policies.loader import parse_policy
from policies.model import Policy
from policies.signing import SignatureBundle, add_signature, sign_policy

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"
EXAMPLE = EXAMPLES / "two-fab-campus.toml"
NOW = 1_780_000_000.0  # 2026-05-28, well before the test policies expire


def key(name: str) -> SigningKey:
    """The published test key called ``name``."""
    return SigningKey.from_seed(hashlib.sha256(b"sluicegate-test-key/" + name.encode()).digest())


EXAMPLE_KEY_NAMES = (
    "officer-alice",
    "officer-bob",
    "officer-carol",
    "broker-1",
    "north-l1-pc",
    "north-l2-pc",
    "south-l1-pc",
    "south-l2-pc",
    "north-gpu-1",
    "north-gpu-2",
    "south-npu-1",
    "cloud-gpu-1",
)


def workers(*names: str) -> dict[str, str]:
    """A pool's ``workers`` table: each worker id with its published test key."""
    return {name: key(name).public_text for name in names}


def toml_value(value: Any) -> str:
    """A TOML inline value (JSON strings are valid TOML basic strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
        )
    raise TypeError(type(value))


def toml_string(text: str) -> str:
    """A TOML basic string: escapes what TOML requires, keeps other characters as they are."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def to_toml(doc: dict[str, Any]) -> str:
    """A document as top-level ``key = inline value`` lines (one way among many to spell it)."""
    return "".join(f"{toml_string(k)} = {toml_value(v)}\n" for k, v in doc.items())


def base_doc(
    *,
    version: int = 1,
    expires: str = "2030-01-01T00:00:00Z",
    signers: tuple[str, ...] = ("officer-alice", "officer-bob", "officer-carol"),
    threshold: int = 2,
) -> dict[str, Any]:
    """A small two-fab policy as a plain dict (expires as an RFC 3339 string)."""
    return {
        "format": "sluicegate-policy/1",
        "campus": "acme",
        "version": version,
        "expires": expires,
        "policy_signers": {
            "threshold": threshold,
            "keys": {name: key(name).public_text for name in signers},
        },
        "broker_signers": {"keys": {"broker-1": key("broker-1").public_text}},
        "zones": {
            "campus/fab-north/line-1": "north line 1",
            "campus/fab-north/dc": "north data centre",
            "campus/fab-south/line-1": "south line 1",
            "campus/fab-south/dc": "south data centre",
            "offsite/cloud-east": "cloud",
        },
        "pools": {
            "north-dc": {"zone": "campus/fab-north/dc", "workers": workers("north-gpu-1")},
            "south-dc": {"zone": "campus/fab-south/dc", "workers": workers("south-npu-1")},
            "cloud": {"zone": "offsite/cloud-east", "workers": workers("cloud-gpu-1")},
        },
        "edges": {
            "north-l1-pc": {
                "zone": "campus/fab-north/line-1",
                "key": key("north-l1-pc").public_text,
            }
        },
        "classes": {
            "wafer-image": {"allow": ["campus/**"], "deny": ["offsite/**"]},
            "ocr-crop": {"allow": ["campus/**", "campus/** -> offsite/cloud-east"]},
        },
        "subhealth": [
            {
                "name": "memory-bound",
                "when": [
                    {"metric": "utilisation", "op": ">=", "value": 0.7},
                    {"metric": "memory_bandwidth", "op": ">=", "value": 0.9},
                ],
            }
        ],
    }


def policy_of(doc: dict[str, Any]) -> Policy:
    return parse_policy(to_toml(doc), source="test.toml")


def signed(policy: Policy, *names: str, bundle: SignatureBundle | None = None) -> SignatureBundle:
    """``bundle`` plus signatures of ``policy`` by the named test keys (id = name)."""
    for name in names:
        bundle = add_signature(bundle, policy, sign_policy(policy, key(name), name))
    assert bundle is not None
    return bundle


# -- sister campuses -------------------------------------------------------------------------

CA_FINGERPRINTS = {"north-site": "sha256:" + "1" * 64, "south-site": "sha256:" + "2" * 64}
SITE_OFFICERS = {
    "north-site": ("officer-alice", "officer-bob", "officer-carol"),
    "south-site": ("officer-dan", "officer-erin"),
}
SITE_ZONES = {"north-site": "campus/north-site/dc", "south-site": "campus/south-site/dc"}
PARTS_TERMS: dict[str, Any] = {
    "classes": ["ocr-crop"],
    "max_jobs_per_s": 50.0,
    "max_bytes_per_s": 2e7,
    "currency": "EUR",
    "device_second": 0.002,
}


def site_doc(
    name: str,
    peer: str,
    *,
    send: dict[str, Any],
    receive: dict[str, Any],
    version: int = 1,
    expires: str = "2030-01-01T00:00:00Z",
) -> dict[str, Any]:
    """A campus policy (``base_doc`` under the campus id ``name``, its own data centre zone
    added with a pool of one worker ``<name>-gpu-1``, its broker ``<name>-broker-1``)
    naming ``peer`` under [peers] with the terms each way, its officers' threshold 2 and its
    broker ``<peer>-broker-1``."""
    doc = base_doc(version=version, expires=expires, signers=SITE_OFFICERS[name])
    doc["campus"] = name
    doc["broker_signers"] = {"keys": {f"{name}-broker-1": key(f"{name}-broker-1").public_text}}
    doc["zones"][SITE_ZONES[name]] = f"{name} data centre"
    doc["pools"][f"{name}-dc"] = {"zone": SITE_ZONES[name], "workers": workers(f"{name}-gpu-1")}
    doc["peers"] = {
        peer: {
            "ca_fingerprint": CA_FINGERPRINTS[peer],
            "brokers": {f"{peer}-broker-1": key(f"{peer}-broker-1").public_text},
            "officers": {
                "threshold": 2,
                "keys": {n: key(n).public_text for n in SITE_OFFICERS[peer]},
            },
            "send": {**send, "zones": [SITE_ZONES[peer]]},
            "receive": {**receive, "zones": [SITE_ZONES[name]]},
        }
    }
    return doc
