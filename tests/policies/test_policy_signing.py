"""Policy signing and acceptance: each attack is refused with its own reason."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from policy_testkit import EXAMPLE, NOW, base_doc, key, policy_of, signed

from policies.errors import (
    BadSignature,
    PolicyDigestMismatch,
    PolicyExpired,
    PolicyParseError,
    PolicyRollback,
    PolicyVersionConflict,
    RotationNotAuthorised,
    ThresholdNotMet,
    UnknownSigner,
)
from policies.keys import SigningKey, signature_valid
from policies.loader import load_policy, parse_policy, read_bytes
from policies.signing import (
    SignatureBundle,
    TrustAnchor,
    accept_policy,
    add_signature,
    dump_anchor,
    dump_signatures,
    open_envelope,
    parse_anchor,
    parse_signatures,
    sign_policy,
    signed_envelope,
)

V1 = policy_of(base_doc(version=1))
V2 = policy_of(base_doc(version=2))


def test_threshold_of_distinct_signers_is_accepted() -> None:
    anchor = accept_policy(V1, signed(V1, "officer-alice", "officer-carol"), now=NOW, anchor=None)
    assert anchor == TrustAnchor(1, V1.digest, 2, V1.signer_keys)
    assert accept_policy(V2, signed(V2, "officer-bob", "officer-carol"), now=NOW, anchor=anchor)
    # Accepting the very same policy again is not a conflict.
    assert accept_policy(V1, signed(V1, "officer-alice", "officer-bob"), now=NOW, anchor=anchor)


def test_shipped_example_signatures_verify() -> None:
    policy = load_policy(EXAMPLE)
    sig_path = EXAMPLE.with_name(EXAMPLE.name + ".sig")
    bundle = parse_signatures(read_bytes(sig_path), source=str(sig_path))
    assert accept_policy(policy, bundle, now=NOW, anchor=None).version == 1


def test_attack_one_tampered_byte_in_the_policy() -> None:
    text = EXAMPLE.read_text()
    bundle = parse_signatures(EXAMPLE.with_name(EXAMPLE.name + ".sig").read_bytes())
    tampered = text.replace("workers = { south-npu-1 =", "workers = { south-npu-2 =")
    assert len(tampered) == len(text)
    assert tampered != text
    with pytest.raises(PolicyDigestMismatch, match="changed after it was signed"):
        accept_policy(parse_policy(tampered), bundle, now=NOW, anchor=None)


def test_attack_signature_by_an_unknown_key() -> None:
    bundle = signed(V1, "officer-alice", "mallory")
    with pytest.raises(UnknownSigner, match="'mallory'") as info:
        accept_policy(V1, bundle, now=NOW, anchor=None)
    assert info.value.reason == "policy.unknown_signer"


def test_attack_forged_signature_bytes() -> None:
    good = signed(V1, "officer-alice", "officer-bob")
    forged = replace(good.signatures[1], signature=bytes(64))
    bundle = replace(good, signatures=(good.signatures[0], forged))
    with pytest.raises(BadSignature, match="'officer-bob'"):
        accept_policy(V1, bundle, now=NOW, anchor=None)


def test_attack_duplicated_signature_counts_once() -> None:
    one = sign_policy(V1, key("officer-alice"), "officer-alice")
    bundle = SignatureBundle(V1.version, V1.digest, (one, one))
    with pytest.raises(ThresholdNotMet, match="needs 2 distinct signer keys, got 1"):
        accept_policy(V1, bundle, now=NOW, anchor=None)


def test_attack_same_key_under_two_ids_counts_once() -> None:
    doc = base_doc()
    doc["policy_signers"]["keys"]["alice-again"] = key("officer-alice").public_text
    policy = policy_of(doc)
    bundle = SignatureBundle(
        policy.version,
        policy.digest,
        (
            sign_policy(policy, key("officer-alice"), "officer-alice"),
            sign_policy(policy, key("officer-alice"), "alice-again"),
        ),
    )
    with pytest.raises(ThresholdNotMet, match="got 1"):
        accept_policy(policy, bundle, now=NOW, anchor=None)


def test_attack_rollback_to_an_older_version() -> None:
    anchor = TrustAnchor.of(V2)
    with pytest.raises(PolicyRollback, match="version 1 is older than the accepted version 2"):
        accept_policy(V1, signed(V1, "officer-alice", "officer-bob"), now=NOW, anchor=anchor)


def test_same_version_with_other_content_is_a_conflict() -> None:
    doc = base_doc(version=1)
    doc["description"] = "changed without a version bump"
    other = policy_of(doc)
    with pytest.raises(PolicyVersionConflict, match="needs a higher version"):
        accept_policy(
            other, signed(other, "officer-alice", "officer-bob"), now=NOW, anchor=TrustAnchor.of(V1)
        )


def test_attack_freeze_with_an_expired_policy() -> None:
    old = policy_of(base_doc(expires="2026-01-01T00:00:00Z"))
    with pytest.raises(PolicyExpired, match="expired at 2026-01-01T00:00:00Z"):
        accept_policy(old, signed(old, "officer-alice", "officer-bob"), now=NOW, anchor=None)


def test_attack_rotation_not_signed_by_the_old_threshold() -> None:
    new = policy_of(base_doc(version=2, signers=("officer-dave", "officer-erin"), threshold=2))
    anchor = TrustAnchor.of(V1)
    only_new = signed(new, "officer-dave", "officer-erin")
    with pytest.raises(RotationNotAuthorised, match="2 distinct keys of the previous signers"):
        accept_policy(new, only_new, now=NOW, anchor=anchor)
    one_old = signed(new, "officer-alice", bundle=only_new)
    with pytest.raises(RotationNotAuthorised, match="1 did"):
        accept_policy(new, one_old, now=NOW, anchor=anchor)
    both = signed(new, "officer-bob", bundle=one_old)
    assert accept_policy(new, both, now=NOW, anchor=anchor).signer_keys == new.signer_keys


def test_lowering_the_threshold_is_a_rotation_too() -> None:
    lowered = policy_of(base_doc(version=2, threshold=1))
    with pytest.raises(RotationNotAuthorised):
        accept_policy(lowered, signed(lowered, "officer-alice"), now=NOW, anchor=TrustAnchor.of(V1))


def test_add_signature_replaces_the_same_key_and_restarts_for_a_new_digest() -> None:
    bundle = signed(V1, "officer-alice", "officer-alice", "officer-bob")
    assert [s.key_id for s in bundle.signatures] == ["officer-alice", "officer-bob"]
    restarted = add_signature(bundle, V2, sign_policy(V2, key("officer-carol"), "officer-carol"))
    assert restarted.digest == V2.digest
    assert [s.key_id for s in restarted.signatures] == ["officer-carol"]


def test_signature_and_anchor_files_round_trip() -> None:
    bundle = signed(V1, "officer-alice", "officer-bob")
    assert parse_signatures(dump_signatures(bundle)) == bundle
    anchor = TrustAnchor.of(V1)
    assert parse_anchor(dump_anchor(anchor)) == anchor


@pytest.mark.parametrize(
    ("data", "expect"),
    [
        (b"[", "not JSON"),
        (b'{"format": "x"}', "format"),
        (json.dumps({"format": "sluicegate-policy-signatures/1"}).encode(), "version"),
    ],
)
def test_bad_signature_and_anchor_files(data: bytes, expect: str) -> None:
    with pytest.raises(PolicyParseError, match=expect):
        parse_signatures(data, source="x.sig")
    with pytest.raises(PolicyParseError):
        parse_anchor(data, source="anchor.json")


def test_signed_envelope_round_trip_and_errors() -> None:
    bundle = signed(V1, "officer-alice", "officer-bob")
    message = signed_envelope(V1, bundle)
    policy, anchor = open_envelope(message, now=NOW, anchor=None)
    assert policy.digest == V1.digest
    assert anchor.version == 1
    with pytest.raises(PolicyRollback):
        open_envelope(message, now=NOW, anchor=TrustAnchor.of(V2))
    for bad, expect in [
        (b"{", "not JSON"),
        (b"[]", "the keys 'policy' and 'signatures'"),
        (b'{"policy": {}, "signatures": {}, "extra": 1}', "the keys 'policy' and 'signatures'"),
        (b'{"policy": NaN, "signatures": {}}', "not JSON"),
    ]:
        with pytest.raises(PolicyParseError, match=expect):
            open_envelope(bad, now=NOW, anchor=None)


def test_signatures_are_standard_ed25519_both_ways() -> None:
    """The signer (libsodium) and OpenSSL make the same bytes and accept each other's: the
    key files, policies and records signed before still check."""
    signer = SigningKey.from_seed(bytes(range(32)))
    message = b"sluicegate usage record"
    ours = signer.sign(message)
    assert ours == signer.private.sign(message)
    Ed25519PublicKey.from_public_bytes(signer.public).verify(ours, message)  # raises if not
    assert signature_valid(signer.public, signer.private.sign(message), message)
    assert not signature_valid(signer.public, ours, message + b".")
    assert not signature_valid(signer.public, ours[:63], message)  # cut short: not a signature
    with pytest.raises(ValueError, match="32 bytes"):
        signature_valid(signer.public[:31], ours, message)
