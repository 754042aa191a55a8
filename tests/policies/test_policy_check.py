"""Policy lint findings (the Mosquitto ACL is tested in tests/test_acl.py)."""

from __future__ import annotations

from typing import Any

from policy_testkit import EXAMPLE, EXAMPLE_KEY_NAMES, base_doc, key, policy_of, workers

from policies.check import PUBLISHED_TEST_KEYS, check_policy
from policies.loader import load_policy

POLICY = load_policy(EXAMPLE)


def _codes(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    findings = check_policy(policy_of(doc))
    return [(f.severity, f.code, f.key) for f in findings if f.code != "test-key"]


def test_every_published_test_key_is_flagged() -> None:
    assert {key(name).public_text for name in EXAMPLE_KEY_NAMES} == PUBLISHED_TEST_KEYS
    findings = check_policy(POLICY)
    assert {f.code for f in findings} == {"test-key"}
    assert len(findings) == len(EXAMPLE_KEY_NAMES)


def test_clean_policy_has_no_findings() -> None:
    assert _codes(base_doc()) == []


def test_unknown_zones_are_errors() -> None:
    doc = base_doc()
    doc["pools"]["west"] = {"zone": "campus/fab-west/dc", "workers": workers("west-1")}
    doc["edges"]["west-pc"] = {"zone": "campus/fab-west/l1", "key": key("broker-2").public_text}
    doc["classes"]["ocr-crop"]["deny"] = ["offsite/cloud-west", "campus/fab-west/** -> campus/**"]
    assert _codes(doc) == [
        ("error", "unknown-zone", "pools.west.zone"),
        ("error", "unknown-zone", "edges.west-pc.zone"),
        ("error", "unknown-zone", "classes.ocr-crop.deny[0]"),
        ("error", "unknown-zone", "classes.ocr-crop.deny[1]"),
    ]


def test_shadowed_redundant_and_unprocessable() -> None:
    doc = base_doc()
    doc["classes"]["wafer-image"]["allow"] = ["campus/**", "campus/fab-north/dc"]
    doc["classes"]["sealed"] = {"allow": ["campus/fab-north/dc"], "deny": ["campus/**"]}
    codes = _codes(doc)
    assert ("warning", "redundant", "classes.wafer-image.allow[1]") in codes
    assert ("warning", "shadowed", "classes.sealed.allow[0]") in codes
    assert ("warning", "unprocessable-class", "classes.sealed") in codes
    assert not any(code[2] == "classes.wafer-image" for code in codes)


def test_key_reuse_and_id_collisions() -> None:
    doc = base_doc()
    doc["policy_signers"]["keys"]["alice-again"] = key("officer-alice").public_text
    doc["broker_signers"]["keys"]["north-gpu-1"] = key("officer-bob").public_text
    doc["edges"]["south-npu-1"] = {"zone": "campus/fab-south/dc", "key": key("mallory").public_text}
    codes = _codes(doc)
    assert ("error", "shared-key", "broker_signers.keys.north-gpu-1") in codes
    assert ("error", "id-collision", "broker_signers.keys.north-gpu-1") in codes
    assert ("error", "id-collision", "edges.south-npu-1") in codes
    assert ("warning", "duplicate-key", "policy_signers.keys.alice-again") in codes
    assert codes.index(("warning", "duplicate-key", "policy_signers.keys.alice-again")) > max(
        i for i, c in enumerate(codes) if c[0] == "error"
    )
