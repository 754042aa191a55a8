"""Twin verdicts: judged against thresholds with each failure named, signed, and checked the
way the broker and nodes check them before a gated change (each way to refuse one)."""

from __future__ import annotations

import hashlib

import pytest

from policies.errors import (
    PolicyParseError,
    VerdictBadSignature,
    VerdictFailed,
    VerdictMissing,
    VerdictOtherCandidate,
    VerdictUnknownSigner,
    VerdictWeakThresholds,
)
from policies.keys import SigningKey
from policies.verdict import (
    Body,
    Candidate,
    Figures,
    Thresholds,
    Verdict,
    check_verdict,
    judge,
    read_verdict,
    sign_verdict,
)

TWIN = SigningKey.from_seed(b"t" * 32)
OTHER = SigningKey.from_seed(b"o" * 32)
CANDIDATE = Candidate(kind="policy", digest=hashlib.sha256(b"v2").hexdigest(), version=2)
TRACE = hashlib.sha256(b"trace").hexdigest()
REQUIRED = Thresholds(min_attainment=0.95, max_queue_depth=64)
GOOD = Figures(attainment=0.98, peak_queue_depth={"north-cpu-1": 12}, violations=0)


def _verdict(
    figures: Figures = GOOD,
    thresholds: Thresholds = REQUIRED,
    candidate: Candidate = CANDIDATE,
    key: SigningKey = TWIN,
) -> Verdict:
    passed, reasons = judge(figures, thresholds)
    body = Body(
        candidate=candidate,
        trace_sha256=TRACE,
        thresholds=thresholds,
        figures=figures,
        passed=passed,
        reasons=reasons,
        issued_at=1_796_000_000.0,
    )
    return sign_verdict(body, key, "twin-1")


def _check(verdict: Verdict | None, candidate: Candidate = CANDIDATE) -> None:
    check_verdict(verdict, trusted={"twin-1": TWIN.public}, candidate=candidate, required=REQUIRED)


def test_a_passing_verdict_for_the_candidate_is_accepted_after_a_round_trip() -> None:
    verdict = read_verdict(_verdict().to_bytes())
    assert verdict.body.passed
    _check(verdict)


def test_judging_names_each_failed_threshold() -> None:
    figures = Figures(
        attainment=0.81,
        peak_queue_depth={"north-cpu-1": 300, "cloud-cpu-1": 3},
        violations=0,
        left_campus={"wafer-image": {"offsite/cloud-east": 212}},
    )
    passed, reasons = judge(figures, REQUIRED)
    assert not passed
    assert reasons == [
        "deadline attainment 0.8100 is below the minimum 0.95",
        "north-cpu-1 would hold 300 jobs at its peak, more than the 64 allowed",
        "212 wafer-image jobs would run in offsite/cloud-east, off site, where the policy in "
        "force keeps wafer-image on campus",
    ]


def test_a_failing_verdict_is_refused_naming_why() -> None:
    leaky = GOOD.model_copy(update={"left_campus": {"wafer-image": {"offsite/cloud-east": 5}}})
    with pytest.raises(VerdictFailed, match="5 wafer-image jobs would run in offsite"):
        _check(_verdict(leaky))


def test_a_verdict_that_claims_to_pass_with_failing_figures_is_refused() -> None:
    bad = GOOD.model_copy(update={"peak_queue_depth": {"north-cpu-1": 500}})
    body = _verdict().body.model_copy(update={"figures": bad})  # still says passed
    with pytest.raises(VerdictFailed, match="500 jobs"):
        _check(sign_verdict(body, TWIN, "twin-1"))


def test_no_verdict_is_refused() -> None:
    with pytest.raises(VerdictMissing, match="needs a passing twin verdict"):
        _check(None)


def test_a_verdict_by_an_untrusted_key_is_refused() -> None:
    with pytest.raises(VerdictUnknownSigner, match="not a twin key"):
        _check(_verdict(key=OTHER))


def test_a_verdict_changed_after_signing_is_refused() -> None:
    verdict = _verdict(GOOD.model_copy(update={"attainment": 0.5}))
    better = verdict.body.model_copy(update={"figures": GOOD, "passed": True, "reasons": []})
    forged = verdict.model_copy(update={"body": better})
    with pytest.raises(VerdictBadSignature, match="changed after it was signed"):
        _check(forged)


def test_a_verdict_for_another_candidate_is_refused() -> None:
    other = Candidate(kind="policy", digest=hashlib.sha256(b"v3").hexdigest(), version=3)
    with pytest.raises(VerdictOtherCandidate, match="rehearse this change itself"):
        _check(_verdict(candidate=other))
    params = Candidate(kind="params", digest=CANDIDATE.digest)
    with pytest.raises(VerdictOtherCandidate):
        _check(_verdict(), candidate=params)


def test_a_verdict_passed_on_looser_thresholds_is_refused() -> None:
    loose = Thresholds(min_attainment=0.5, max_queue_depth=1000)
    with pytest.raises(VerdictWeakThresholds, match=r"min_attainment 0\.5 < required 0\.95"):
        _check(_verdict(thresholds=loose))


def test_a_document_that_is_not_a_verdict_is_a_parse_error() -> None:
    with pytest.raises(PolicyParseError, match="sluicegate-verdict/1"):
        read_verdict(b'{"body": {}}')


def test_a_placement_the_candidates_own_policy_forbids_fails_the_verdict() -> None:
    passed, reasons = judge(GOOD.model_copy(update={"violations": 2}), REQUIRED)
    assert not passed
    assert reasons == [
        "2 placements break the candidate's own policy (a fault in the placement code: never "
        "expected)"
    ]


def test_key_or_signature_text_that_is_not_base64url_is_refused() -> None:
    good = _verdict()
    with pytest.raises(VerdictUnknownSigner):
        _check(good.model_copy(update={"public": "not base64url!"}))
    with pytest.raises(VerdictBadSignature):
        _check(good.model_copy(update={"signature": "not+base64/url"}))
