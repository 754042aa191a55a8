"""A policy's [rollout] gate: under a policy that requires it, the next version is accepted
only with a passing twin verdict for its own digest, signed by a twin key the accepted
policy lists; the gate survives a restart (it rides in the persisted anchor); a policy
without the table is unchanged (same digest, no verdict needed)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from policy_testkit import NOW, base_doc, key, policy_of, signed

from policies.canonical import canonical_bytes, canonical_json
from policies.errors import (
    PolicyParseError,
    VerdictFailed,
    VerdictMissing,
    VerdictOtherCandidate,
    VerdictUnknownSigner,
    VerdictWeakConditions,
    VerdictWeakThresholds,
)
from policies.keys import b64u_encode
from policies.loader import parse_canonical
from policies.model import Policy
from policies.schema import PolicyDocument
from policies.signing import (
    TrustAnchor,
    accept_policy,
    dump_anchor,
    open_envelope,
    parse_anchor,
    signed_envelope,
)
from policies.verdict import (
    DOMAIN,
    Body,
    Candidate,
    Figures,
    Thresholds,
    Verdict,
    judge,
    sign_verdict,
)

TWIN = key("twin-1")
GATE = {"twin_keys": {"twin-1": TWIN.public_text}, "require_verdict": True, "min_attainment": 0.9}


def _gated(version: int, **rollout: Any) -> Policy:
    doc = base_doc(version=version)
    doc["rollout"] = {**GATE, **rollout}
    return policy_of(doc)


V1 = _gated(1)
V2 = _gated(2)
TRACE = hashlib.sha256(b"a trace").hexdigest()


def _verdict(
    policy: Policy,
    figures: Figures | None = None,
    signer: str = "twin-1",
    burst: float | None = None,
    margin: float | None = None,
) -> Verdict:
    figures = figures or Figures(attainment=0.97, peak_queue_depth={"w": 3}, violations=0)
    thresholds = Thresholds(min_attainment=0.9, max_queue_depth=64, max_drop_points=margin)
    passed, reasons = judge(figures, thresholds)
    body = Body(
        candidate=Candidate(kind="policy", digest=policy.digest.hex(), version=policy.version),
        trace_sha256=TRACE,
        thresholds=thresholds,
        figures=figures,
        passed=passed,
        reasons=reasons,
        issued_at=NOW,
        burst=burst,
    )
    return sign_verdict(body, key(signer), "twin-1")


def _accept(policy: Policy, verdict: Verdict | None, anchor: TrustAnchor) -> TrustAnchor:
    return accept_policy(
        policy,
        signed(policy, "officer-alice", "officer-bob"),
        now=NOW,
        anchor=anchor,
        verdict=verdict,
    )


ANCHOR = accept_policy(V1, signed(V1, "officer-alice", "officer-bob"), now=NOW, anchor=None)


def test_the_next_version_needs_a_verdict_and_passes_with_its_own() -> None:
    with pytest.raises(VerdictMissing, match="version 2"):
        _accept(V2, None, ANCHOR)
    assert _accept(V2, _verdict(V2), ANCHOR).version == 2


def test_the_policy_held_is_accepted_again_without_one() -> None:
    assert _accept(V1, None, ANCHOR).digest == V1.digest


def test_a_verdict_for_another_version_an_untrusted_key_or_a_failure_is_refused() -> None:
    with pytest.raises(VerdictOtherCandidate):
        _accept(V2, _verdict(_gated(3)), ANCHOR)
    with pytest.raises(VerdictUnknownSigner):
        _accept(V2, _verdict(V2, signer="officer-carol"), ANCHOR)
    leaky = Figures(
        attainment=0.97,
        peak_queue_depth={},
        violations=0,
        left_campus={"wafer-image": {"offsite/cloud-east": 40}},
    )
    with pytest.raises(VerdictFailed, match="40 wafer-image jobs would run in offsite"):
        _accept(V2, _verdict(V2, leaky), ANCHOR)


def test_the_gate_rides_in_the_persisted_anchor() -> None:
    again = parse_anchor(dump_anchor(ANCHOR))
    assert again == ANCHOR
    with pytest.raises(VerdictMissing):
        _accept(V2, None, again)


def test_the_verdict_travels_in_the_signed_envelope() -> None:
    bundle = signed(V2, "officer-alice", "officer-bob")
    with pytest.raises(VerdictMissing):
        open_envelope(signed_envelope(V2, bundle), now=NOW, anchor=ANCHOR)
    policy, anchor = open_envelope(
        signed_envelope(V2, bundle, _verdict(V2)), now=NOW, anchor=ANCHOR
    )
    assert (policy.version, anchor.version) == (2, 2)
    assert policy.rollout is not None
    assert policy.rollout.require_verdict


def test_a_policy_without_the_table_keeps_its_digest_and_needs_no_verdict() -> None:
    plain = policy_of(base_doc(version=1))
    assert plain.rollout is None
    assert b"rollout" not in canonical_bytes(PolicyDocument.model_validate_json(plain.canonical))
    assert parse_canonical(plain.canonical).digest == plain.digest
    anchor = accept_policy(
        plain, signed(plain, "officer-alice", "officer-bob"), now=NOW, anchor=None
    )
    nxt = policy_of(base_doc(version=2))
    assert _accept(nxt, None, anchor).version == 2


def test_requiring_a_verdict_without_a_twin_key_is_refused() -> None:
    doc = base_doc(version=1)
    doc["rollout"] = {"require_verdict": True}
    with pytest.raises(PolicyParseError, match="needs at least one twin key"):
        policy_of(doc)


def test_a_gate_can_require_the_rehearsal_to_have_burst_the_arrivals() -> None:
    strict = _gated(1, min_burst=3.0)
    anchor = accept_policy(
        strict, signed(strict, "officer-alice", "officer-bob"), now=NOW, anchor=None
    )
    assert parse_anchor(dump_anchor(anchor)) == anchor  # the requirement is persisted
    with pytest.raises(VerdictWeakConditions, match=r"rehearsed at 1x .* 3x at least"):
        _accept(V2, _verdict(V2), anchor)
    with pytest.raises(VerdictWeakConditions, match="rehearsed at 2x"):
        _accept(V2, _verdict(V2, burst=2.0), anchor)
    assert _accept(V2, _verdict(V2, burst=5.0), anchor).version == 2


def test_a_gate_can_require_a_verdict_judged_against_the_policy_in_force() -> None:
    strict = _gated(1, max_drop_points=1.0)
    anchor = accept_policy(
        strict, signed(strict, "officer-alice", "officer-bob"), now=NOW, anchor=None
    )
    assert parse_anchor(dump_anchor(anchor)) == anchor  # the requirement is persisted
    with pytest.raises(VerdictWeakThresholds, match="max_drop_points none > required 1"):
        _accept(V2, _verdict(V2), anchor)
    with pytest.raises(VerdictWeakThresholds, match="max_drop_points 2 > required 1"):
        _accept(V2, _verdict(V2, margin=2.0), anchor)
    assert _accept(V2, _verdict(V2, margin=0.5), anchor).version == 2


def test_the_new_fields_are_left_out_where_not_set_so_digests_and_signatures_hold() -> None:
    # A gated policy without min_burst or max_drop_points has no such key in its canonical
    # form.
    for field in ("min_burst", "max_drop_points"):
        assert field.encode() not in V1.canonical
        assert field.encode() in _gated(1, **{field: 2.0}).canonical
    # A verdict signed before the fields existed (its body's JSON without them) still
    # verifies.
    body = _verdict(V2).body
    later: dict[str, Any] = {
        "burst": True,
        "thresholds": {"max_drop_points"},
        "figures": {"by_line", "by_class", "in_force", "moved"},
    }
    old = body.model_dump(mode="json", exclude=later)
    signature = TWIN.sign(DOMAIN + canonical_json(old))
    before = Verdict(
        body=body,
        key_id="twin-1",
        public=b64u_encode(TWIN.public),
        signature=b64u_encode(signature),
    )
    assert _accept(V2, before, ANCHOR).version == 2
