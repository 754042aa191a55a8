"""Property-based tests (hypothesis): canonical form, evaluator semantics, parser robustness,
token integrity and the replay cache."""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime as dt
import json
import math
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_testkit import EXAMPLE, NOW, key, to_toml, workers

from policies.errors import PolicyDigestMismatch, PolicyParseError, ReplayCacheFull, TokenRefused
from policies.evaluate import allowed
from policies.loader import load_policy, parse_canonical, parse_policy
from policies.replay import MemoryReplayCache
from policies.signing import accept_policy, parse_signatures
from policies.tokens import mint, payload_digest, verify

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SEGMENTS = ["campus", "offsite", "fab-a", "fab-b", "dc", "line-1", "cloud"]
SIGNERS = ["officer-alice", "officer-bob", "officer-carol", "officer-dave"]

zone_names = st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3).map("/".join)


@st.composite
def patterns(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 9)) == 0:
        return "**"
    segs = draw(st.lists(st.sampled_from([*SEGMENTS, "*"]), min_size=1, max_size=3))
    return "/".join(segs) + ("/**" if draw(st.booleans()) else "")


@st.composite
def rules(draw: st.DrawFn) -> str:
    target = draw(patterns())
    return f"{draw(patterns())} -> {target}" if draw(st.booleans()) else target


texts = st.text(max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    zones = draw(st.dictionaries(zone_names, texts, min_size=1, max_size=6))
    signers = draw(st.lists(st.sampled_from(SIGNERS), min_size=1, max_size=4, unique=True))
    moment = draw(st.datetimes(dt.datetime(2001, 1, 1), dt.datetime(9998, 1, 1)))
    classes = draw(
        st.dictionaries(
            st.sampled_from(["wafer", "ocr", "recipe"]),
            st.fixed_dictionaries(
                {"allow": st.lists(rules(), max_size=3), "deny": st.lists(rules(), max_size=3)},
                optional={"description": texts},
            ),
            min_size=1,
            max_size=3,
        )
    )
    worker_zones = draw(st.lists(st.sampled_from(sorted(zones)), max_size=3))
    return {
        "format": "sluicegate-policy/1",
        "campus": draw(st.sampled_from(["acme", "beta-1"])),
        "version": draw(st.integers(1, 2**32 - 1)),
        "expires": moment.replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "description": draw(texts),
        "policy_signers": {
            "threshold": draw(st.integers(1, len(signers))),
            "keys": {name: key(name).public_text for name in signers},
        },
        "broker_signers": {"keys": {"broker-1": key("broker-1").public_text}},
        "zones": zones,
        "pools": {
            f"pool-{i}": {"zone": zone, "workers": workers(f"w-{i}")}
            for i, zone in enumerate(worker_zones)
        },
        "classes": classes,
        "subhealth": [
            {"name": "hot", "when": [{"metric": "util", "op": ">=", "value": draw(finite)}]}
        ],
        "tokens": {"max_ttl_s": draw(st.integers(1, 3600))},
    }


def _reordered(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reordered(v) for k, v in reversed(list(value.items()))}
    if isinstance(value, list):
        return [_reordered(v) for v in value]
    return value


@FAST
@given(documents())
def test_canonical_round_trips_and_ignores_spelling(doc: dict[str, Any]) -> None:
    policy = parse_policy(to_toml(doc))
    again = parse_canonical(policy.canonical)
    assert again.canonical == policy.canonical
    assert parse_policy(to_toml(_reordered(doc))).digest == policy.digest
    assert parse_canonical(json.dumps(doc).encode()).digest == policy.digest


def _mutations(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for change in range(7):
        new = copy.deepcopy(doc)
        if change == 0:
            new["version"] = doc["version"] % (2**32 - 1) + 1
        elif change == 1:
            new["description"] += "x"
        elif change == 2:
            new["zones"]["campus/new-zone"] = ""
        elif change == 3:
            value = doc["subhealth"][0]["when"][0]["value"]
            # Step toward zero so the neighbour of the largest float stays finite.
            step = math.nextafter(value, 0.0) if value != 0 else math.nextafter(0.0, 1.0)
            new["subhealth"][0]["when"][0]["value"] = step
        elif change == 4:
            cls = next(iter(new["classes"].values()))
            cls["deny"] = [*cls["deny"], "campus/new-zone"]
        elif change == 5:
            new["tokens"]["max_ttl_s"] = doc["tokens"]["max_ttl_s"] % 3600 + 1
        else:
            new["broker_signers"]["keys"]["broker-2"] = key("broker-2").public_text
        out.append(new)
    return out


@FAST
@given(documents())
def test_any_change_to_the_content_changes_the_digest(doc: dict[str, Any]) -> None:
    digest = parse_policy(to_toml(doc)).digest
    for changed in _mutations(doc):
        assert parse_policy(to_toml(changed)).digest != digest


def _oracle(pattern: str) -> re.Pattern[str]:
    parts = pattern.split("/")
    subtree = parts[-1] == "**"
    fixed = parts[:-1] if subtree else parts
    body = "/".join("[^/]+" if p == "*" else re.escape(p) for p in fixed)
    if subtree:
        body = f"(?:{body}(?:/.*)?)" if fixed else ".*"
    return re.compile(body)


def _rule_matches(rule: str, origin: str, target: str) -> bool:
    o, _, t = rule.rpartition(" -> ")
    return bool(_oracle(t).fullmatch(target)) and bool(_oracle(o or "**").fullmatch(origin))


@FAST
@given(documents(), st.data())
def test_evaluator_is_deny_wins_and_default_deny(doc: dict[str, Any], data: st.DataObject) -> None:
    policy = parse_policy(to_toml(doc))
    zones = [*doc["zones"], "nowhere/else"]
    for _ in range(10):
        cls = data.draw(st.sampled_from([*doc["classes"], "unknown"]))
        origin = data.draw(st.sampled_from(zones))
        target = data.draw(st.sampled_from(zones))
        verdict = allowed(policy, cls, origin, target)
        spec = doc["classes"].get(cls)
        known = spec is not None and origin in doc["zones"] and target in doc["zones"]
        denied = known and any(_rule_matches(r, origin, target) for r in spec["deny"])
        permitted = known and any(_rule_matches(r, origin, target) for r in spec["allow"])
        assert verdict.allowed == (known and permitted and not denied)
        if verdict.allowed:
            assert verdict.rule is not None
            assert verdict.rule.effect == "allow"
        elif denied:
            assert verdict.rule is not None
            assert verdict.rule.effect == "deny"
        else:
            assert verdict.rule is None


@FAST
@given(documents(), rules())
def test_adding_a_deny_rule_never_grants_anything(doc: dict[str, Any], extra: str) -> None:
    before = parse_policy(to_toml(doc))
    cls = next(iter(doc["classes"]))
    widened = copy.deepcopy(doc)
    widened["classes"][cls]["deny"].append(extra)
    after = parse_policy(to_toml(widened))
    for origin in doc["zones"]:
        for target in doc["zones"]:
            if allowed(after, cls, origin, target).allowed:
                assert allowed(before, cls, origin, target).allowed


def _assert_clean(call: Any) -> None:
    """Either a policy or a ``PolicyParseError``: any other exception fails the test."""
    with contextlib.suppress(PolicyParseError):
        call()


@FUZZ
@given(st.binary(max_size=600))
def test_parser_random_bytes_only_clean_errors(data: bytes) -> None:
    _assert_clean(lambda: parse_policy(data, source="fuzz.toml"))
    _assert_clean(lambda: parse_canonical(data, source="fuzz.json"))


EXAMPLE_BYTES = EXAMPLE.read_bytes()


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(EXAMPLE_BYTES)), st.binary(max_size=4)), max_size=4))
def test_parser_mutated_example_only_clean_errors(edits: list[tuple[int, bytes]]) -> None:
    data = EXAMPLE_BYTES
    for pos, chunk in edits:
        data = data[:pos] + chunk + data[pos + len(chunk) + 1 :]
    _assert_clean(lambda: parse_policy(data, source="fuzz.toml"))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | finite | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=20,
)


@FUZZ
@given(
    st.dictionaries(st.sampled_from(["format", "zones", "classes", "version", "x"]), json_values)
)
def test_parser_random_structures_only_clean_errors(doc: dict[str, Any]) -> None:
    scalars_only = {k: v for k, v in doc.items() if v is not None}
    _assert_clean(lambda: parse_policy(to_toml_lenient(scalars_only), source="fuzz.toml"))
    _assert_clean(lambda: parse_canonical(json.dumps(doc).encode(), source="fuzz.json"))


def to_toml_lenient(doc: dict[str, Any]) -> str:
    """TOML for arbitrary JSON-ish values (None, which TOML lacks, becomes a string)."""

    def fix(value: Any) -> Any:
        if value is None:
            return "null"
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        return value

    return to_toml(fix(doc))


POLICY = load_policy(EXAMPLE)
TOKEN = mint(
    POLICY,
    key("broker-1"),
    job_id="job-1",
    payload_sha256=payload_digest(b"image"),
    data_class="wafer-image",
    origin_zone="campus/fab-north/line-1",
    target_worker="north-gpu-1",
    now=NOW,
    nonce=bytes(16),
)
TOKEN_BITS = len(base64.urlsafe_b64decode(TOKEN + "==")) * 8


@settings(max_examples=400, deadline=None)
@given(st.integers(0, TOKEN_BITS - 1))
def test_every_single_bit_flip_is_refused(bit: int) -> None:
    raw = bytearray(base64.urlsafe_b64decode(TOKEN + "=="))
    raw[bit // 8] ^= 1 << (bit % 8)
    flipped = base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()
    try:
        verify(
            flipped,
            POLICY,
            now=NOW,
            job_id="job-1",
            payload_sha256=payload_digest(b"image"),
            worker_id="north-gpu-1",
        )
    except TokenRefused:
        return
    raise AssertionError(f"flipping bit {bit} was accepted")


@FAST
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c", b"d"]), st.integers(0, 5)), max_size=40),
)
def test_replay_cache_never_accepts_a_live_nonce_twice(
    capacity: int, steps: list[tuple[bytes, int]]
) -> None:
    cache = MemoryReplayCache(max_entries=capacity)
    live: dict[bytes, float] = {}
    now = 0.0
    for nonce, lifetime in steps:
        now += 1
        until = now + lifetime
        try:
            fresh = cache.claim(nonce, until, now)
        except ReplayCacheFull:
            assert sum(1 for u in live.values() if u >= now) >= capacity
            continue
        was_live = live.get(nonce, -1.0) >= now
        assert fresh is not was_live
        if fresh:
            live[nonce] = until
        assert len(cache) <= capacity


EXAMPLE_BUNDLE = parse_signatures(EXAMPLE.with_name(EXAMPLE.name + ".sig").read_bytes())


@FUZZ
@given(st.integers(0, len(EXAMPLE_BYTES) - 1), st.integers(0, 255))
def test_a_changed_byte_is_refused_unless_the_content_is_unchanged(pos: int, value: int) -> None:
    data = EXAMPLE_BYTES[:pos] + bytes([value]) + EXAMPLE_BYTES[pos + 1 :]
    try:
        policy = parse_policy(data)
    except PolicyParseError:
        return
    if policy.canonical == POLICY.canonical:  # e.g. inside a comment: same policy
        accept_policy(policy, EXAMPLE_BUNDLE, now=NOW, anchor=None)
        return
    with pytest.raises(PolicyDigestMismatch):
        accept_policy(policy, EXAMPLE_BUNDLE, now=NOW, anchor=None)
