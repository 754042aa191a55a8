"""Evaluation tables, explanations, zone patterns and sub-health rules."""

from __future__ import annotations

import pytest
from policy_testkit import EXAMPLE, key

from policies import evaluate
from policies.evaluate import allowed, allowed_targets, decide, explain, kept_on_site
from policies.loader import load_policy
from policies.model import ZonePattern
from policies.subhealth import is_subhealthy

POLICY = load_policy(EXAMPLE)
N1 = "campus/fab-north/line-1"
NDC = "campus/fab-north/dc"
SDC = "campus/fab-south/dc"
CLOUD = "offsite/cloud-east"


@pytest.mark.parametrize(
    ("data_class", "origin", "target", "ok", "decision", "rule"),
    [
        ("wafer-image", N1, NDC, True, "allow-rule", "classes.wafer-image.allow[0]"),
        ("wafer-image", N1, SDC, True, "allow-rule", "classes.wafer-image.allow[0]"),
        ("wafer-image", N1, CLOUD, False, "deny-rule", "classes.wafer-image.deny[0]"),
        ("recipe-overlay", N1, NDC, True, "allow-rule", "classes.recipe-overlay.allow[0]"),
        ("recipe-overlay", N1, SDC, False, "default-deny", None),
        ("recipe-overlay", N1, CLOUD, False, "deny-rule", "classes.recipe-overlay.deny[0]"),
        ("ocr-crop", N1, CLOUD, True, "allow-rule", "classes.ocr-crop.allow[1]"),
        ("ocr-crop", CLOUD, CLOUD, False, "default-deny", None),
        ("secret", N1, NDC, False, "unknown-class", None),
        ("wafer-image", "campus/fab-west/line-1", NDC, False, "unknown-origin", None),
        ("wafer-image", N1, "campus/fab-north", False, "unknown-target", None),
    ],
)
def test_verdicts(
    data_class: str, origin: str, target: str, ok: bool, decision: str, rule: str | None
) -> None:
    verdict = allowed(POLICY, data_class, origin, target)
    assert verdict.allowed is ok
    assert verdict.decision == decision
    assert (verdict.rule.key if verdict.rule else None) == rule
    assert allowed(POLICY, data_class, origin, target) is verdict  # memoised
    assert decide(POLICY, data_class, origin, target) == verdict
    assert data_class in str(verdict)


def test_verdict_sentences() -> None:
    assert "deny wins" in str(allowed(POLICY, "wafer-image", N1, CLOUD))
    assert "default deny" in str(allowed(POLICY, "recipe-overlay", N1, SDC))
    assert "unknown data class 'x'" in str(allowed(POLICY, "x", N1, SDC))
    assert "unknown origin zone 'nowhere'" in str(allowed(POLICY, "ocr-crop", "nowhere", SDC))
    assert "unknown target zone 'nowhere'" in str(allowed(POLICY, "ocr-crop", N1, "nowhere"))
    assert "allowed by allow[1]" in str(allowed(POLICY, "ocr-crop", N1, CLOUD))


def test_allowed_targets() -> None:
    assert CLOUD not in allowed_targets(POLICY, "wafer-image", N1)
    assert allowed_targets(POLICY, "recipe-overlay", N1) == [
        NDC,
        N1,
        "campus/fab-north/line-2",
    ]


def test_a_class_kept_on_site_may_leave_from_none_of_the_zones() -> None:
    assert kept_on_site(POLICY, "wafer-image", "campus")  # denied off site, from anywhere
    assert kept_on_site(POLICY, "recipe-overlay", "campus")
    assert not kept_on_site(POLICY, "ocr-crop", "campus")  # the cloud takes labels
    assert not kept_on_site(POLICY, "wafer-image", "campus/fab-north")  # fab-south is "off"
    assert kept_on_site(POLICY, "secret", "campus")  # an unknown class goes nowhere


def test_explain_in_words() -> None:
    lines = explain(POLICY, "wafer-image", N1, CLOUD)
    assert lines[0].startswith("Question: may data class 'wafer-image'")
    assert any("deny[0]" in line and "MATCHES" in line for line in lines)
    assert lines[-1].startswith("Answer: DENIED")
    unknown = explain(POLICY, "secret", "nowhere", CLOUD)
    assert any(
        "not in the policy; known: ocr-crop, recipe-overlay, wafer-image" in x for x in unknown
    )
    assert any("Zone 'nowhere' is not declared" in x for x in unknown)
    assert explain(POLICY, "ocr-crop", N1, CLOUD)[-1].startswith("Answer: ALLOWED")


def test_verdict_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = load_policy(EXAMPLE)
    monkeypatch.setattr(evaluate, "VERDICT_CACHE_LIMIT", 2)
    for target in (NDC, SDC, CLOUD, N1):
        allowed(policy, "wafer-image", N1, target)
    assert len(policy.verdict_cache) <= 2


@pytest.mark.parametrize(
    ("pattern", "zone", "match"),
    [
        ("campus/**", "campus", True),
        ("campus/**", "campus/fab-north/dc", True),
        ("campus/**", "offsite/cloud", False),
        ("campus/*/dc", "campus/fab-north/dc", True),
        ("campus/*/dc", "campus/fab-north/line-1", False),
        ("campus/*/dc", "campus/fab-north", False),
        ("campus/*", "campus/fab-north/dc", False),
        ("**", "anything/at/all", True),
        ("campus/fab-north/dc", "campus/fab-north/dc", True),
    ],
)
def test_zone_patterns(pattern: str, zone: str, match: bool) -> None:
    assert ZonePattern.parse(pattern).matches(tuple(zone.split("/"))) is match


def test_role_of_keys() -> None:
    assert POLICY.role_of(key("officer-bob").public) == "policy signer 'officer-bob'"
    assert POLICY.role_of(key("broker-1").public) == "broker 'broker-1'"
    assert POLICY.role_of(key("south-l2-pc").public) == "edge 'south-l2-pc'"
    assert POLICY.role_of(key("mallory").public) is None


@pytest.mark.parametrize(
    ("metrics", "sick", "rule", "missing"),
    [
        ({"utilisation": 0.75, "memory_bandwidth": 0.95}, True, "memory-bound", ()),
        ({"utilisation": 0.75, "memory_bandwidth": 0.5}, False, None, ("temperature_c",)),
        (
            {"utilisation": 0.5, "memory_bandwidth": 0.95, "temperature_c": 90},
            True,
            "overheating",
            (),
        ),
        (
            {"temperature_c": float("nan")},
            False,
            None,
            ("memory_bandwidth", "temperature_c", "utilisation"),
        ),
        ({"utilisation": 0.1, "memory_bandwidth": 0.1, "temperature_c": 40}, False, None, ()),
    ],
)
def test_subhealth_rules(
    metrics: dict[str, float], sick: bool, rule: str | None, missing: tuple[str, ...]
) -> None:
    verdict = is_subhealthy(POLICY.subhealth, metrics)
    assert verdict.subhealthy is sick
    assert (verdict.rule.name if verdict.rule else None) == rule
    assert verdict.missing == missing
    text = str(verdict)
    if sick:
        assert "sub-healthy by rule" in text
    elif missing:
        assert "missing" in text
    else:
        assert text.startswith("healthy")


def test_memory_bound_rule_reads_like_the_policy() -> None:
    verdict = is_subhealthy(POLICY.subhealth, {"utilisation": 0.7, "memory_bandwidth": 0.9})
    assert str(verdict) == (
        "sub-healthy by rule 'memory-bound' (utilisation >= 0.7 and memory_bandwidth >= 0.9)"
    )


@pytest.mark.parametrize(
    ("op", "value", "holds"),
    [(">", 0.5, False), (">", 0.6, True), ("<=", 0.5, True), ("<", 0.5, False), ("<", 0.4, True)],
)
def test_condition_operators(op: str, value: float, holds: bool) -> None:
    from policies.model import Condition, SubhealthRule

    rule = SubhealthRule("r", (Condition("m", op, 0.5),))
    assert is_subhealthy([rule], {"m": value}).subhealthy is holds
