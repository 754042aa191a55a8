"""A learned placement policy: it orders only what the rules allow, it may keep a job on its
edge, and it is loaded only as the file its manifest names."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from broker.core.decision import Placed, Refused
from broker.core.learned import FEATURES, HEURISTIC, LearnedPolicy, digest_path, load, save
from broker.core.params import PlacementParams
from broker.core.placement import decide
from broker.core.reference import decide_reference
from broker.errors import InvalidParams
from tests.test_broker_core_kit import (
    NOW,
    PARAMS,
    request,
)
from tests.test_broker_core_placement import POLICY, three_workers

OFF_SITE = FEATURES.index("off_site")
LOAD = FEATURES.index("load")


def _with(policy: LearnedPolicy) -> PlacementParams:
    return replace(PARAMS, learned=policy)


def _weights(**named: float) -> tuple[float, ...]:
    return tuple(named.get(f, 0.0) for f in FEATURES)


def test_the_heuristic_as_a_policy_places_where_the_rules_do() -> None:
    busy = {"queue_depth": 6, "capacity": 16}
    for loads in (None, {"gpu-1": busy}, {"gpu-1": busy, "npu-1": busy}):
        for data_class in ("wafer-image", "ocr-crop"):
            req = request(data_class=data_class, deadline_at=NOW + 0.5)
            plain = decide(three_workers(loads), req, POLICY, now=NOW, params=PARAMS)
            learned = decide(three_workers(loads), req, POLICY, now=NOW, params=_with(HEURISTIC))
            assert isinstance(plain, Placed)
            assert isinstance(learned, Placed)
            assert learned.worker_id == plain.worker_id


def test_weights_reorder_the_allowed_workers_and_never_reach_a_forbidden_one() -> None:
    # A policy that wants off-site workers above all: an ocr crop (allowed off site) goes
    # there; a wafer image (campus only) never does, however much the weights want it.
    keen = LearnedPolicy(_weights(off_site=-100.0))
    ocr = decide(
        three_workers(), request(data_class="ocr-crop"), POLICY, now=NOW, params=_with(keen)
    )
    assert isinstance(ocr, Placed)
    assert ocr.worker_id == "cloud-1"
    wafer = decide(
        three_workers(), request(data_class="wafer-image"), POLICY, now=NOW, params=_with(keen)
    )
    assert isinstance(wafer, Placed)
    assert wafer.worker_id != "cloud-1"
    # One that prefers the emptier worker over the faster one.
    light = LearnedPolicy(_weights(load=1.0))
    loads = {"gpu-1": {"queue_depth": 8, "capacity": 16}}
    chosen = decide(three_workers(loads), request(), POLICY, now=NOW, params=_with(light))
    assert isinstance(chosen, Placed)
    assert chosen.worker_id == "npu-1"


def test_a_policy_keeps_a_job_its_edge_meets_with_room_to_spare() -> None:
    keeper = LearnedPolicy(HEURISTIC.weights, keep_share=0.5)
    roomy = request(deadline_at=NOW + 0.2, local_estimate_ms=60.0)
    kept = decide(three_workers(), roomy, POLICY, now=NOW, params=_with(keeper))
    assert isinstance(kept, Refused)
    assert kept.code == "kept_local"
    assert "60.0 ms" in kept.reason
    tight = request(deadline_at=NOW + 0.2, local_estimate_ms=150.0)
    assert isinstance(decide(three_workers(), tight, POLICY, now=NOW, params=_with(keeper)), Placed)
    # The rules come first: a class the policy sends nowhere is refused as before.
    nowhere = request(data_class="secret", deadline_at=NOW + 0.2, local_estimate_ms=1.0)
    refused = decide(three_workers(), nowhere, POLICY, now=NOW, params=_with(keeper))
    assert isinstance(refused, Refused)
    assert refused.code == "policy_denied"


def test_a_policy_file_loads_only_as_its_manifest_names_it(tmp_path: Path) -> None:
    policy = LearnedPolicy(_weights(predicted=1.0, off_site=0.3), 0.25, "7", {"method": "x"})
    path = tmp_path / "placement.json"
    digest = save(policy, path)
    assert digest_path(path).read_text().split() == [digest, "placement.json"]
    assert load(path) == policy
    assert load(path).trained == {"method": "x"}
    path.write_text(path.read_text().replace('"7"', '"8"'))
    with pytest.raises(InvalidParams, match=r"sha256 .* says"):
        load(path)
    digest_path(path).unlink()
    with pytest.raises(InvalidParams, match="placement policy"):
        load(path)


@pytest.mark.parametrize(
    ("weights", "keep", "words"),
    [
        ((1.0,) * 3, 0.0, f"has {len(FEATURES)} weights"),
        ((float("nan"),) * len(FEATURES), 0.0, "finite"),
        ((0.0,) * len(FEATURES), 1.5, "keep_share"),
    ],
)
def test_a_malformed_policy_is_refused_naming_the_problem(
    weights: tuple[float, ...], keep: float, words: str
) -> None:
    with pytest.raises(InvalidParams, match=words):
        LearnedPolicy(weights, keep)


def test_a_policy_for_other_features_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    save(HEURISTIC, path)
    text = path.read_text().replace('"off_site"', '"elsewhere"')
    path.write_text(text)
    digest_path(path).write_text(f"{hashlib.sha256(text.encode()).hexdigest()}  old.json\n")
    with pytest.raises(InvalidParams, match="retrain it"):
        load(path)


def test_a_learned_policy_rides_the_placement_parameters_and_their_digest() -> None:
    plain = PlacementParams()
    learned = _with(LearnedPolicy(_weights(predicted=1.0, off_site=0.5), 0.2, "3"))
    assert "learned" not in plain.describe()  # the digest of a set without one is unchanged
    again = PlacementParams.from_mapping(learned.describe())
    assert again == learned
    assert again.digest() == learned.digest() != replace(PARAMS, learned=None).digest()
    with pytest.raises(InvalidParams, match="placement policy learned"):
        PlacementParams.from_mapping({"learned": {"format": "other"}})


def test_the_brute_force_reference_decides_the_same_with_a_policy() -> None:
    policies = (
        HEURISTIC,
        LearnedPolicy(_weights(off_site=-100.0)),
        LearnedPolicy(_weights(load=1.0, predicted=0.2), keep_share=0.5),
    )
    busy = {"queue_depth": 8, "capacity": 16}
    for policy in policies:
        for loads in (None, {"gpu-1": busy}, {"npu-1": busy, "cloud-1": busy}):
            for data_class in ("wafer-image", "ocr-crop"):
                req = request(data_class=data_class, deadline_at=NOW + 0.2, local_estimate_ms=80.0)
                fleet = three_workers(loads)
                fast = decide(fleet, req, POLICY, now=NOW, params=_with(policy))
                assert fast == decide_reference(fleet, req, POLICY, now=NOW, params=_with(policy))
