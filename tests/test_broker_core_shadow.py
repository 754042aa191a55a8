"""Shadow placement: a candidate decides each request beside production, through the same
decision code, on a fleet fed the same events; its choices are counted against
production's (same, moved and where, refused, forbidden by the policy in force) and never
touch production's fleet."""

from __future__ import annotations

from broker.core.decision import Placed
from broker.core.fleet import Fleet
from broker.core.params import FleetParams, PlacementParams
from broker.core.placement import decide
from broker.core.shadow import Shadow, outcome_of
from tests.test_broker_core_kit import (
    CLOUD,
    NDC,
    NOW,
    PARAMS,
    campus_policy,
    caps,
    completion,
    request,
    telemetry,
)

POLICY = campus_policy({NDC: ["gpu-1"], CLOUD: ["cloud-1"]})
LEAKY = campus_policy(
    {NDC: ["gpu-1"], CLOUD: ["cloud-1"]},
    classes={"wafer-image": {"allow": ["campus/**", "campus/** -> offsite/**"]}},
    version=2,
)
# Off site made free and on campus slow: the candidate sends what it may to the cloud.
CLOUD_FIRST = PlacementParams(link_latency_ms=(0.2, 500.0, 0.0), link_mb_per_s=(1e3, 1.0, 1e6))


def _both(
    candidate_policy: object = None, params: PlacementParams = PARAMS
) -> tuple[Fleet, Shadow]:
    fleet = Fleet(None, None, POLICY)
    shadow = Shadow(
        policy=candidate_policy,  # type: ignore[arg-type]
        params=params,
        fleet_params=FleetParams(),
    )
    for cap in (caps("gpu-1", NDC), caps("cloud-1", CLOUD)):
        for target in (fleet, shadow):
            target.apply_capabilities(cap, NOW)
            target.apply_telemetry(telemetry(cap.worker_id, NOW, zone=cap.zone), NOW)
    return fleet, shadow


def _run(fleet: Fleet, shadow: Shadow, job: str, data_class: str) -> tuple[str, str]:
    req = request(job, data_class=data_class)
    production = decide(fleet, req, POLICY, now=NOW, params=PARAMS)
    assert isinstance(production, Placed)
    fleet.reserve(production.worker_id, job, NOW, req.model)
    compared = shadow.compare(req, production, POLICY, now=NOW)
    return production.worker_id, compared.candidate


def test_the_same_candidate_agrees_with_production_every_time() -> None:
    fleet, shadow = _both()
    for i in range(6):
        _run(fleet, shadow, f"j{i}", "ocr-crop")
    tally = shadow.tally.describe()
    assert tally["decisions"] == 6
    assert tally["agreement"] == 1.0
    assert tally["recent_differences"] == []


def test_other_parameters_move_jobs_that_may_move_and_nothing_else() -> None:
    fleet, shadow = _both(params=CLOUD_FIRST)
    assert _run(fleet, shadow, "ocr", "ocr-crop") == ("gpu-1", "cloud-1")
    # wafer images may not leave the campus under either's policy: both keep them there
    assert _run(fleet, shadow, "wafer", "wafer-image") == ("gpu-1", "gpu-1")
    tally = shadow.tally.describe()
    assert tally["outcomes"]["moved"] == 1
    assert tally["outcomes"]["same"] == 1
    assert tally["moved"] == [{"production": "gpu-1", "candidate": "cloud-1", "jobs": 1}]
    assert tally["forbidden"] == []
    (diff,) = tally["recent_differences"]
    assert diff["job_id"] == "ocr"
    # Nothing the shadow decided reached production's fleet.
    assert fleet.reservation("ocr") == "gpu-1"
    assert fleet.reserved("cloud-1") == 0
    assert shadow.fleet.reservation("ocr") == "cloud-1"


def test_a_candidate_policy_that_would_send_wafers_off_site_is_caught_on_live_traffic() -> None:
    fleet, shadow = _both(LEAKY, CLOUD_FIRST)
    assert _run(fleet, shadow, "wafer", "wafer-image") == ("gpu-1", "cloud-1")
    tally = shadow.tally.describe()
    assert tally["forbidden"] == [{"data_class": "wafer-image", "zone": CLOUD, "jobs": 1}]
    assert tally["recent_differences"][0]["forbidden"] is True


def test_a_candidate_that_refuses_is_counted_by_its_code() -> None:
    fleet, shadow = _both()
    shadow.mark_offline("gpu-1", NOW)  # seen by the shadow only: its fleet is its own
    shadow.mark_offline("cloud-1", NOW)
    production, candidate = _run(fleet, shadow, "j", "ocr-crop")
    assert production == "gpu-1"  # production, which heard no such thing, still places
    assert candidate.startswith("refused:")
    tally = shadow.tally.describe()
    assert tally["outcomes"]["candidate_refused"] == 1
    assert tally["candidate_refusals"] == {candidate.removeprefix("refused:"): 1}


def test_completions_reach_the_shadows_fleet() -> None:
    fleet, shadow = _both()
    _run(fleet, shadow, "j", "ocr-crop")
    assert shadow.fleet.reserved("gpu-1") == 1
    shadow.apply_completion(completion("j", "gpu-1", 20.0), NOW + 0.1)
    assert shadow.fleet.reserved("gpu-1") == 0


def test_outcomes_cover_every_pair() -> None:
    fleet, _ = _both()
    placed = decide(fleet, request("a"), POLICY, now=NOW, params=PARAMS)
    other = decide(fleet, request("b", model="nobody-has-it"), POLICY, now=NOW, params=PARAMS)
    assert isinstance(placed, Placed)
    assert not isinstance(other, Placed)
    assert outcome_of(placed, placed) == "same"
    assert outcome_of(placed, other) == "candidate_refused"
    assert outcome_of(other, placed) == "candidate_placed"
    assert outcome_of(other, other) == "same"
