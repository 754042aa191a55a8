"""Placement decisions: every filter, every refusal code, scores and explanations."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core.decision import Placed, Refused, as_record
from broker.core.params import FleetParams
from broker.core.placement import decide
from broker.core.reference import decide_reference
from sluicegate.vision.manifest import Requirements
from sluicegate.wire_pool import WorkerCapabilities
from tests.test_broker_core_kit import (
    CLOUD,
    N1,
    NDC,
    NOW,
    PARAMS,
    S1,
    SDC,
    campus_policy,
    caps,
    fleet_with,
    request,
    telemetry,
)

POLICY = campus_policy()
# Fires the policy's "memory-bound" sub-health rule.
HOT: dict[str, Any] = {"utilisation": 0.8, "memory_bandwidth": 0.95}


def placed(decision: object) -> Placed:
    assert isinstance(decision, Placed), decision
    return decision


def refused(decision: object) -> Refused:
    assert isinstance(decision, Refused), decision
    return decision


def both(fleet: Any, req: Any, policy: Any = POLICY, now: float = NOW) -> Any:
    """The fast path's decision, checked against the brute-force reference."""
    fast = decide(fleet, req, policy, now=now, params=PARAMS)
    slow = decide_reference(fleet, req, policy, now=now, params=PARAMS)
    assert fast == slow
    return fast


Load = dict[str, Any]


def three_workers(loads: dict[str, Load] | None = None) -> Any:
    kw = loads or {}
    return fleet_with(
        POLICY,
        [
            (caps("gpu-1", NDC), kw.get("gpu-1", {})),
            (caps("npu-1", SDC, device_class="ascend-910b"), kw.get("npu-1", {})),
            (caps("cloud-1", CLOUD), kw.get("cloud-1", {})),
        ],
    )


@pytest.mark.parametrize(
    ("data_class", "origin", "allowed_workers"),
    [
        ("wafer-image", N1, {"gpu-1", "npu-1"}),
        ("ocr-crop", N1, {"gpu-1", "npu-1", "cloud-1"}),
        ("recipe-overlay", N1, {"gpu-1"}),
        ("recipe-overlay", S1, {"npu-1"}),
    ],
)
def test_policy_filter_decides_which_workers_are_candidates(
    data_class: str, origin: str, allowed_workers: set[str]
) -> None:
    fleet = three_workers()
    decision = placed(both(fleet, request(data_class=data_class, origin_zone=origin)))
    assert decision.worker_id in allowed_workers
    assert decision.candidates.eligible == len(allowed_workers)
    assert decision.candidates.removed("policy") == 3 - len(allowed_workers)


def test_campus_only_class_never_goes_off_site_even_when_it_is_the_only_idle_worker() -> None:
    busy: Load = {"queue_depth": 15, "in_flight": 0, "capacity": 16}
    fleet = three_workers({"gpu-1": busy, "npu-1": busy})
    assert placed(both(fleet, request(data_class="ocr-crop"))).worker_id == "cloud-1"
    decision = placed(both(fleet, request(data_class="wafer-image")))
    assert decision.worker_id != "cloud-1"
    full: Load = {"queue_depth": 16, "capacity": 16}
    fleet = three_workers({"gpu-1": full, "npu-1": full})
    refusal = refused(both(fleet, request(data_class="wafer-image")))
    assert refusal.code == "no_capacity"
    assert "all 2 workers" in refusal.reason
    assert refusal.candidates.removed("policy") == 1


def test_policy_denied_names_class_origin_zone_and_rule() -> None:
    fleet = fleet_with(POLICY, [(caps("cloud-1", CLOUD), {})])
    decision = refused(both(fleet, request(data_class="wafer-image")))
    assert decision.code == "policy_denied"
    for part in ("'wafer-image'", N1, CLOUD, "deny[0] 'offsite/**'", "it may go to"):
        assert part in decision.reason, decision.reason
    unknown = refused(both(fleet, request(data_class="secret")))
    assert unknown.code == "policy_denied"
    assert "known classes: ocr-crop, recipe-overlay, wafer-image" in unknown.reason
    nowhere = refused(both(fleet, request(origin_zone="campus/fab-west/line-9")))
    assert "'campus/fab-west/line-9' is not declared" in nowhere.reason


def test_unknown_zone_of_worker_is_denied() -> None:
    # A worker in no pool of the policy has no zone the policy knows: never a candidate.
    fleet = fleet_with(POLICY, [(caps("stray-1", NDC), {})])
    decision = refused(both(fleet, request()))
    assert decision.code == "no_worker"
    assert decision.candidates.removed("not_in_policy") == 1
    assert "in no pool of policy v1" in decision.reason


def test_declared_zone_must_match_the_policy() -> None:
    # gpu-1's pool is the north DC; a worker claiming to be elsewhere is not trusted.
    fleet = fleet_with(POLICY, [(caps("gpu-1", SDC), {})])
    decision = refused(both(fleet, request()))
    assert decision.code == "no_worker"
    assert decision.candidates.removed("zone_mismatch") == 1
    assert "declare a zone other than their pool's" in decision.reason


@pytest.mark.parametrize(
    ("worker_kw", "code", "reason"),
    [
        ({"models": ("ocr-v2",)}, "no_worker", "no online worker has model 'defect-v1'"),
        ({"providers": ("CPUExecutionProvider",)}, "no_worker", "1 lack the execution provider"),
        ({"memory_total_mb": 4_000}, "no_worker", "1 have too little free memory"),
    ],
)
def test_model_and_requirement_filters(worker_kw: dict[str, Any], code: str, reason: str) -> None:
    needs = {"defect-v1": Requirements(providers=("CUDAExecutionProvider",), memory_mb=8_000)}
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC, **worker_kw), {})], requirements=needs)
    decision = refused(both(fleet, request()))
    assert decision.code == code
    assert reason in decision.reason, decision.reason
    if code == "no_worker" and "provider" in reason:
        assert "any of providers CUDAExecutionProvider and 8000 MiB free memory" in decision.reason


def test_memory_requirement_counts_memory_in_use() -> None:
    needs = {"defect-v1": Requirements(memory_mb=8_000)}
    workers: list[tuple[WorkerCapabilities, Load]] = [
        (caps("gpu-1", NDC), {"memory_used_mb": 35_000.0}),  # 5,000 MiB free
        (caps("npu-1", SDC, device_class="ascend-910b"), {"memory_used_mb": 30_000.0}),
    ]
    fleet = fleet_with(POLICY, workers, requirements=needs)
    decision = placed(both(fleet, request()))
    assert decision.worker_id == "npu-1"
    assert decision.candidates.removed("memory") == 1


def test_provider_requirement_is_any_of() -> None:
    needs = {
        "defect-v1": Requirements(providers=("CANNExecutionProvider", "CUDAExecutionProvider"))
    }
    workers: list[tuple[WorkerCapabilities, Load]] = [
        (caps("gpu-1", NDC, providers=("CPUExecutionProvider",)), {}),
        (caps("npu-1", SDC, device_class="ascend-910b", providers=("CANNExecutionProvider",)), {}),
    ]
    fleet = fleet_with(POLICY, workers, requirements=needs)
    assert placed(both(fleet, request())).worker_id == "npu-1"


def test_offline_and_unknown_model() -> None:
    fleet = three_workers()
    fleet.mark_offline("gpu-1", NOW)
    fleet.mark_offline("npu-1", NOW)
    decision = refused(both(fleet, request()))
    assert decision.code == "policy_denied"  # only the off-site worker is left
    assert decision.candidates.removed("offline") == 2
    unknown = refused(both(three_workers(), request(model="defect-v9")))
    assert unknown.code == "no_worker"
    assert (
        unknown.reason == "no online worker has model 'defect-v9'; models in the fleet: defect-v1"
    )


def test_a_cordoned_worker_takes_no_new_placement_until_lifted() -> None:
    fleet = three_workers()
    first = placed(both(fleet, request())).worker_id
    fleet.cordon(first, True)
    other = placed(both(fleet, request(job_id="j-2")))
    assert other.worker_id != first
    assert other.candidates.removed("cordoned") == 1
    assert fleet.headroom(first) == 0
    view = fleet.view(first)
    assert view is not None
    assert view.cordoned
    fleet.cordon(other.worker_id, True)
    none = refused(both(fleet, request(job_id="j-3")))
    assert none.code == "no_worker"
    assert "2 are cordoned by an operator" in none.reason
    assert "it needs" not in none.reason
    fleet.cordon(first, False)
    assert placed(both(fleet, request(job_id="j-4"))).worker_id == first


def test_subhealthy_worker_gets_nothing_while_a_healthy_one_has_room() -> None:
    # gpu-1 is idle but memory-bound; npu-1 is healthy and busy: npu-1 still gets the job.
    fleet = three_workers({"gpu-1": HOT, "npu-1": {"queue_depth": 12}})
    for i in range(3):
        decision = placed(both(fleet, request(f"job-{i}")))
        assert decision.worker_id == "npu-1"
        assert decision.candidates.removed("subhealthy") == 1
        fleet.reserve(decision.worker_id, f"job-{i}", NOW)


def test_subhealthy_worker_is_used_when_it_is_the_only_one_with_room() -> None:
    fleet = three_workers({"gpu-1": HOT, "npu-1": {"queue_depth": 16}})
    decision = placed(both(fleet, request()))
    assert decision.worker_id == "gpu-1"
    assert decision.candidates.ranked[0].subhealthy
    overheating = campus_policy(
        subhealth=[{"name": "hot", "when": [{"metric": "temperature_c", "op": ">=", "value": 85}]}]
    )
    fleet = fleet_with(
        overheating,
        [(caps("gpu-1", NDC), {"temperature_c": 90.0}), (caps("npu-1", SDC), {"queue_depth": 9})],
    )
    assert placed(both(fleet, request(), overheating)).worker_id == "npu-1"


def test_reservations_spread_consecutive_decisions() -> None:
    workers: list[tuple[WorkerCapabilities, Load]] = [
        (caps(f"gpu-{i}", NDC), {}) for i in range(1, 5)
    ]
    policy = campus_policy({NDC: [f"gpu-{i}" for i in range(1, 5)]})
    fleet = fleet_with(policy, workers)
    chosen = []
    for i in range(8):
        decision = placed(both(fleet, request(f"job-{i}"), policy))
        fleet.reserve(decision.worker_id, f"job-{i}", NOW)
        chosen.append(decision.worker_id)
    assert sorted(chosen) == sorted([f"gpu-{i}" for i in range(1, 5)] * 2)
    assert chosen[:4] == ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]  # ties go to the lowest id
    assert fleet.release("job-0")
    assert placed(both(fleet, request("job-8"), policy)).worker_id == "gpu-1"


def test_reservations_fill_a_worker_to_capacity() -> None:
    policy = campus_policy({NDC: ["gpu-1"]})
    fleet = fleet_with(policy, [(caps("gpu-1", NDC), {"capacity": 3})])
    for i in range(3):
        fleet.reserve(placed(both(fleet, request(f"j{i}"), policy)).worker_id, f"j{i}", NOW)
    assert refused(both(fleet, request("j3"), policy)).code == "no_capacity"


def test_score_is_queue_wait_plus_learned_service_plus_transfer() -> None:
    fleet = three_workers({"gpu-1": {"queue_depth": 3, "in_flight": 1, "backlog_ms": 40.0}})
    fleet.service.observe("defect-v1", "nvidia-a100", 10.0)
    fleet.service.observe("defect-v1", "ascend-910b", 40.0)
    decision = placed(both(fleet, request(data_class="wafer-image", payload_bytes=200_000)))
    # gpu-1: 40 ms of work held over 2 slots -> 20 ms queue + 10 ms service + transfer
    transfer = 0.5 + 200_000 / (100.0 * 1000.0)
    assert decision.worker_id == "gpu-1"
    best = decision.candidates.ranked[0]
    assert (best.queue_ms, best.service_ms, best.transfer_ms) == (20.0, 10.0, transfer)
    assert decision.predicted_ms == pytest.approx(30.0 + transfer)
    runner_up = decision.candidates.ranked[1]
    assert runner_up.worker_id == "npu-1"
    assert runner_up.predicted_ms == pytest.approx(40.0 + transfer)


def test_the_wait_at_a_worker_weighs_each_job_there_by_its_own_model() -> None:
    """A detector job behind two OCR runs waits for them, not for two detector runs: the
    worker with four short jobs is sooner than the one with two long ones (counted as jobs
    at the request's own service time, the one with fewer jobs looked sooner)."""
    policy = campus_policy({NDC: ["gpu-1", "gpu-2"]})
    fleet = fleet_with(
        policy,
        [
            (caps("gpu-1", NDC), {"queue_depth": 1, "in_flight": 1, "backlog_ms": 140.0}),
            (caps("gpu-2", NDC), {"queue_depth": 2, "in_flight": 2, "backlog_ms": 8.0}),
        ],
    )
    fleet.service.observe("defect-v1", "nvidia-a100", 2.0)
    decision = placed(both(fleet, request(), policy))
    assert decision.worker_id == "gpu-2"
    best, other = decision.candidates.ranked[:2]
    assert (best.queue_ms, other.queue_ms) == (4.0, 70.0)  # held work over two slots
    assert best.predicted_ms == pytest.approx(best.transfer_ms + 4.0 + 2.0)


def test_reservations_wait_at_the_workers_mean_job() -> None:
    """Jobs reserved since the worker's last telemetry are not in its backlog yet: each
    counts as its mean job (its backlog over the jobs it holds)."""
    policy = campus_policy({NDC: ["gpu-1"]})
    fleet = fleet_with(
        policy, [(caps("gpu-1", NDC), {"queue_depth": 1, "in_flight": 1, "backlog_ms": 60.0})]
    )
    fleet.reserve("gpu-1", "r1", NOW)
    fleet.reserve("gpu-1", "r2", NOW)
    decision = placed(both(fleet, request(), policy))
    assert decision.candidates.ranked[0].queue_ms == pytest.approx((60.0 + 2 * 30.0) / 2)


def test_transfer_makes_off_site_slower() -> None:
    fleet = three_workers({"gpu-1": {"queue_depth": 1}})
    fleet.mark_offline("npu-1", NOW)
    # gpu-1 has one job ahead: 25 ms of queue. 1 MB takes 10.5 ms on campus, 120 ms off site.
    big = placed(both(fleet, request(data_class="ocr-crop", payload_bytes=1_000_000)))
    assert big.worker_id == "gpu-1"
    assert big.predicted_ms == pytest.approx(10.5 + 25 + 50)
    # 1 kB: 0.51 ms on campus, 20.1 ms off site; the idle off-site worker is now sooner.
    small = placed(both(fleet, request(data_class="ocr-crop", payload_bytes=1_000)))
    assert small.worker_id == "cloud-1"
    assert small.predicted_ms == pytest.approx(20.1 + 50)
    assert small.candidates.ranked[1].worker_id == "gpu-1"


def test_forecast_penalty_steers_away_from_a_worker_heading_for_capacity() -> None:
    policy = campus_policy({NDC: ["gpu-1", "gpu-2"]})
    params = FleetParams(forecast_penalty=2.0)
    fleet = fleet_with(policy, [], params=params)
    for wid in ("gpu-1", "gpu-2"):
        fleet.apply_capabilities(caps(wid, NDC), NOW)
    # gpu-1: 2 -> 4 -> 6 -> 8 held of 16 over 3 s: +0.125/s, at 0.5 now, 0.875 in 3 s: fine.
    # gpu-2: 0 -> 3 -> 6 -> 9 held: +0.1875/s, at 0.5625 now, 1.125 in 3 s: crosses.
    for step, (a, b) in enumerate([(2, 0), (4, 3), (6, 6), (8, 9)]):
        ts = NOW + step
        fleet.apply_telemetry(telemetry("gpu-1", ts, queue_depth=a), ts)
        fleet.apply_telemetry(telemetry("gpu-2", ts, queue_depth=b), ts)
    now = NOW + 3
    decision = placed(both(fleet, request(), policy, now=now))
    assert decision.worker_id == "gpu-1"
    penalised = decision.candidates.ranked[1]
    assert penalised.worker_id == "gpu-2"
    assert penalised.forecast_load == pytest.approx(1.125)
    # Nine jobs at the 50 ms default over two slots: 225 ms of wait, doubled.
    assert penalised.queue_ms == pytest.approx(225.0)
    assert penalised.penalty_ms == pytest.approx(penalised.queue_ms)
    view = fleet.view("gpu-2")
    assert view is not None
    assert view.forecast is not None
    assert view.forecast.crosses
    assert view.forecast.slope_per_s == pytest.approx(0.1875)


@pytest.mark.parametrize(
    ("deadline_ms", "local_ms", "code"),
    [
        (None, None, "placed"),
        (100.0, None, "placed"),
        (40.0, None, "no_faster_worker"),
        (None, 60.0, "placed"),
        (None, 51.0, "no_faster_worker"),
        (40.0, 60.0, "placed"),  # misses the deadline, but still beats the edge
    ],
)
def test_acceptance_needs_the_deadline_or_beating_the_edge(
    deadline_ms: float | None, local_ms: float | None, code: str
) -> None:
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {})])  # predicts 50 + 1.5 = 51.5 ms
    deadline = None if deadline_ms is None else NOW + deadline_ms / 1000.0
    decision = both(fleet, request(deadline_at=deadline, local_estimate_ms=local_ms))
    assert decision.status == "placed" if code == "placed" else decision.code == code
    if code == "no_faster_worker":
        assert "predicts 51.5 ms (transfer 1.5 + queue 0.0 + service 50.0)" in decision.reason


def test_decision_record_is_plain_data() -> None:
    record = as_record(placed(both(three_workers(), request())))
    assert record["status"] == "placed"
    candidates = record["candidates"]
    assert isinstance(candidates, dict)
    assert candidates["filtered"] == {"policy": 1}
    assert candidates["ranked"][0]["worker_id"] == record["worker_id"]
