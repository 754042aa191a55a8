"""Fleet state: liveness and expiry, reservations, learned service times, forecasts,
policy and requirement changes, and the per-pool demand signal."""

from __future__ import annotations

import dataclasses
import math

import pytest

from broker.core.decision import Placed
from broker.core.demand import fold_arrivals, pool_demand, turned_away_per_pool
from broker.core.fleet import Fleet
from broker.core.forecast import forecast, predict, trend
from broker.core.params import FleetParams, PlacementParams, ServiceParams
from broker.core.placement import decide
from broker.core.service_model import ServiceModel
from broker.core.state import TelemetrySample
from broker.errors import InvalidParams, UnknownWorker
from sluicegate.config import BrokerSettings
from sluicegate.vision.manifest import Requirements
from tests.policies.policy_testkit import base_doc, policy_of
from tests.test_broker_core_kit import (
    NDC,
    NOW,
    PARAMS,
    SDC,
    campus_policy,
    caps,
    completion,
    fleet_with,
    request,
    telemetry,
)

POLICY = campus_policy()


def sample(ts: float, held: int, capacity: int = 10) -> TelemetrySample:
    return TelemetrySample(ts, ts, held, 0, capacity, 0.5, 0.0, None, None, {})


def where(fleet: Fleet, now: float, params: PlacementParams = PARAMS) -> str | None:
    decision = decide(fleet, request(), POLICY, now=now, params=params)
    return decision.worker_id if isinstance(decision, Placed) else None


def test_a_killed_worker_stops_getting_placements_within_three_intervals() -> None:
    settings = BrokerSettings(telemetry_interval_s=1.0, missed_intervals=3)
    params = PlacementParams.from_settings(settings)
    fleet = Fleet(FleetParams.from_settings(settings), None, POLICY)
    fleet.apply_capabilities(caps("gpu-1", NDC), NOW)
    fleet.apply_capabilities(caps("npu-1", SDC, device_class="ascend-910b"), NOW)
    for t in range(4):  # both report every second; gpu-1 is idle, npu-1 busier
        fleet.apply_telemetry(telemetry("gpu-1", NOW + t), NOW + t)
        fleet.apply_telemetry(telemetry("npu-1", NOW + t, zone=SDC, queue_depth=4), NOW + t)
    assert where(fleet, NOW + 3.5, params) == "gpu-1"
    # gpu-1 is killed after its sample at NOW + 3 (no Last Will); npu-1 keeps reporting.
    for t in range(4, 8):
        fleet.apply_telemetry(telemetry("npu-1", NOW + t, zone=SDC, queue_depth=4), NOW + t)
        chosen = where(fleet, NOW + t + 0.01, params)
        assert chosen == ("gpu-1" if t + 0.01 <= 3 + 3.0 else "npu-1"), t
    state = fleet.state("gpu-1")
    assert state is not None
    assert not state.online


def test_expire_reports_silent_workers_once_and_they_come_back_with_telemetry() -> None:
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {}), (caps("npu-1", SDC), {})])
    busy = {"queue_depth": 4, "backlog_ms": 20_000.0}  # still busy when gpu-1 is back
    fleet.apply_telemetry(telemetry("npu-1", NOW + 2, zone=SDC, **busy), NOW + 2)
    assert fleet.expire(NOW + 2.5, 3.0) == []
    assert fleet.expire(NOW + 3.5, 3.0) == ["gpu-1"]
    assert fleet.expire(NOW + 3.6, 3.0) == []
    fleet.apply_telemetry(telemetry("gpu-1", NOW + 4), NOW + 4)
    assert where(fleet, NOW + 4) == "gpu-1"
    assert fleet.expire(NOW + 10, 3.0) == ["npu-1", "gpu-1"]  # longest silent first
    assert where(fleet, NOW + 10) is None


def test_last_will_takes_a_worker_out_at_once_and_hands_back_its_reservations() -> None:
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {}), (caps("npu-1", SDC), {})])
    fleet.reserve("gpu-1", "job-a", NOW)
    fleet.reserve("gpu-1", "job-b", NOW)
    assert fleet.mark_offline("gpu-1", NOW) == ("job-a", "job-b")
    assert fleet.reserved("gpu-1") == 0
    assert fleet.reservation("job-a") is None
    assert where(fleet, NOW) == "npu-1"
    assert fleet.mark_offline("gpu-1", NOW) == ()


def test_capabilities_and_telemetry_are_both_needed() -> None:
    fleet = Fleet(None, None, POLICY)
    fleet.apply_capabilities(caps("gpu-1", NDC), NOW)
    assert where(fleet, NOW) is None  # retained capabilities outlive their worker
    fleet.apply_telemetry(telemetry("npu-1", NOW, zone=SDC), NOW)
    assert where(fleet, NOW) is None  # telemetry alone does not say what it can run
    fleet.apply_telemetry(telemetry("gpu-1", NOW), NOW)
    assert where(fleet, NOW) == "gpu-1"
    fleet.apply_capabilities(caps("npu-1", SDC, device_class="ascend-910b"), NOW)
    view = fleet.view("npu-1")
    assert view is not None
    assert view.statuses == {"defect-v1": "eligible"}
    assert view.policy_zone == SDC


def test_history_is_bounded_and_restarts_when_the_worker_clock_goes_back() -> None:
    fleet = fleet_with(POLICY, [], params=FleetParams(history=4, trend_window=4))
    fleet.apply_capabilities(caps("gpu-1", NDC), NOW)
    for t in range(10):
        fleet.apply_telemetry(telemetry("gpu-1", 100.0 + t, queue_depth=t), NOW + t)
    state = fleet.state("gpu-1")
    assert state is not None
    assert [s.queue_depth for s in state.samples] == [6, 7, 8, 9]
    assert state.last_seen == NOW + 9
    fleet.apply_telemetry(telemetry("gpu-1", 5.0, queue_depth=1), NOW + 10)  # restarted
    state = fleet.state("gpu-1")
    assert state is not None
    assert [s.queue_depth for s in state.samples] == [1]


def test_reservations_count_until_telemetry_shows_them() -> None:
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {})], params=FleetParams(absorb_after_s=0.25))
    fleet.reserve("gpu-1", "job-a", NOW)
    fleet.reserve("gpu-1", "job-a", NOW)  # idempotent
    fleet.reserve("gpu-1", "job-b", NOW + 0.2)
    assert fleet.reserved("gpu-1") == 2
    assert fleet.headroom("gpu-1") == 16 - 2
    fleet.apply_telemetry(telemetry("gpu-1", NOW + 0.3, queue_depth=1), NOW + 0.3)
    assert fleet.headroom("gpu-1") == 16 - 1 - 1
    assert fleet.headroom("ghost") == 0
    assert fleet.reserved("gpu-1") == 1  # job-a is in that sample now; job-b is too fresh
    assert fleet.reservation("job-b") == "gpu-1"
    assert not fleet.release("job-a")
    assert fleet.release("job-b")
    assert not fleet.release("job-b")
    assert fleet.reserved("gpu-1") == 0


def test_a_worker_another_replica_filled_is_full_until_its_next_telemetry() -> None:
    busy = {"queue_depth": 5, "backlog_ms": 5_000.0}  # 2.5 s of work on each of its slots
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {}), (caps("npu-1", SDC), busy)])
    assert where(fleet, NOW) == "gpu-1"
    fleet.mark_full("gpu-1", NOW)
    fleet.mark_full("ghost", NOW)  # unknown: ignored
    assert fleet.marked_full("gpu-1")
    assert fleet.headroom("gpu-1") == 0
    assert where(fleet, NOW) == "npu-1"
    fleet.apply_telemetry(telemetry("gpu-1", NOW + 1), NOW + 1)
    assert not fleet.marked_full("gpu-1")
    assert where(fleet, NOW + 1) == "gpu-1"


def test_a_reservation_moves_and_unknown_workers_are_refused() -> None:
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {}), (caps("npu-1", SDC), {})])
    fleet.reserve("gpu-1", "job-a", NOW)
    fleet.reserve("npu-1", "job-a", NOW)
    assert (fleet.reserved("gpu-1"), fleet.reserved("npu-1")) == (0, 1)
    with pytest.raises(UnknownWorker, match="unknown worker 'ghost'; the fleet knows 2 workers"):
        fleet.reserve("ghost", "job-b", NOW)


def test_completions_release_and_teach_service_times() -> None:
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {})])
    fleet.reserve("gpu-1", "job-a", NOW)
    fleet.apply_completion(completion("job-a", "gpu-1", 20.0), NOW)
    assert fleet.reserved("gpu-1") == 0
    assert fleet.service.estimate("defect-v1", "nvidia-a100") == 20.0
    fleet.apply_completion(completion("job-b", "gpu-1", 40.0), NOW)
    assert fleet.service.estimate("defect-v1", "nvidia-a100") == pytest.approx(24.0)
    failed = completion("job-c", "gpu-1", 1.0).model_copy(update={"status": "failed"})
    fleet.apply_completion(failed, NOW)
    assert fleet.service.estimate("defect-v1", "nvidia-a100") == pytest.approx(24.0)
    assert fleet.service.observations("defect-v1", "nvidia-a100") == 2


def test_service_model_prefers_learned_then_reported_then_default() -> None:
    model = ServiceModel(alpha=0.5, default_ms=50.0)
    assert (model.estimate("m", "gpu"), model.source("m", "gpu")) == (50.0, "default")
    model.report("m", "gpu", 10.0)
    model.report("m", "gpu", 30.0)
    assert (model.estimate("m", "gpu"), model.source("m", "gpu")) == (20.0, "reported")
    model.observe("m", "gpu", 8.0)
    assert (model.estimate("m", "gpu"), model.source("m", "gpu")) == (8.0, "learned")
    for bad in (math.nan, math.inf, -1.0, 0.0):
        model.observe("m", "gpu", bad)
    assert model.estimate("m", "gpu") == 8.0
    model.report("m", "npu", 30.0)
    model.report("m", "gpu", 99.0)  # learned figures win over reported ones
    assert dict(model.table("m")) == {"gpu": 8.0, "npu": 30.0}
    assert dict(model.table("other")) == {}
    copy = ServiceModel(alpha=0.5, default_ms=50.0)
    copy.restore(model.snapshot())
    assert copy.snapshot() == model.snapshot()
    assert copy.table("m") == model.table("m")
    assert copy.observations("m", "gpu") == 1


def test_telemetry_service_times_stand_in_until_completions_arrive() -> None:
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {"service_ms": {"defect-v1": 12.0}})])
    assert fleet.service.estimate("defect-v1", "nvidia-a100") == 12.0
    assert fleet.service.source("defect-v1", "nvidia-a100") == "reported"


@pytest.mark.parametrize(
    ("held", "slope"),
    [
        ([0, 1, 2, 3], 0.1),
        ([5, 5, 5, 5], 0.0),
        ([8, 6, 4, 2], -0.2),
        ([0, 9], 0.0),  # fewer samples than trend_min_samples: no trend
    ],
)
def test_trend_is_the_least_squares_slope(held: list[int], slope: float) -> None:
    samples = [sample(100.0 + i, h) for i, h in enumerate(held)]
    assert trend(samples, window=8, min_samples=3) == pytest.approx(slope)


def test_trend_of_noisy_samples_and_the_forecast() -> None:
    samples = [sample(float(t), h) for t, h in [(0, 0), (1, 2), (2, 1), (3, 3)]]
    # x = 0..3, y = 0, .2, .1, .3: slope = sum((x - 1.5)(y - .15)) / 5 = 0.08
    assert trend(samples, window=8, min_samples=3) == pytest.approx(0.08)
    outlook = forecast(samples, reserved=2, params=FleetParams(forecast_horizon_s=5.0))
    assert outlook.load_now == pytest.approx(0.5)
    assert outlook.predicted == pytest.approx(0.9)
    assert not outlook.crosses
    assert predict(0.1, -1.0, 5.0) == 0.0
    same_time = [sample(1.0, h) for h in (0, 5, 9)]
    assert trend(same_time, window=8, min_samples=3) == 0.0


def test_a_new_policy_moves_workers_between_zones() -> None:
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {})])
    assert where(fleet, NOW) == "gpu-1"
    moved = campus_policy({SDC: ["gpu-1"]}, version=2)  # now declared in the south DC
    decision = decide(fleet, request(), moved, now=NOW, params=PARAMS)
    assert decision.status == "refused"
    assert decision.candidates.removed("zone_mismatch") == 1
    assert fleet.policy is moved
    fleet.use_policy(moved)  # the same policy again: nothing to do
    same_content = campus_policy({SDC: ["gpu-1"]}, version=2)
    fleet.use_policy(same_content)
    assert fleet.policy is same_content


def test_new_requirements_take_effect() -> None:
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC, memory_total_mb=8_000), {})])
    assert where(fleet, NOW) == "gpu-1"
    fleet.set_requirements({"defect-v1": Requirements(memory_mb=16_000)})
    assert where(fleet, NOW) is None
    fleet.set_requirements({})
    assert where(fleet, NOW) == "gpu-1"


def test_forget_drops_a_worker() -> None:
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {})])
    assert fleet.forget("gpu-1")
    assert not fleet.forget("gpu-1")
    assert "gpu-1" not in fleet
    assert len(fleet) == 0
    assert fleet.models() == []
    assert where(fleet, NOW) is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FleetParams(history=1), "history = 1; accepted: 2 <= history <= 4096"),
        (lambda: FleetParams(forecast_penalty=0.5), "forecast_penalty = 0.5"),
        (lambda: PlacementParams(top_k=0), "top_k = 0; accepted: 1 <= top_k <= 100"),
        (lambda: PlacementParams(campus_prefix="a/b"), "campus_prefix = 'a/b'"),
        (
            lambda: PlacementParams(link_mb_per_s=(1.0, 0.0, 1.0)),
            "link_mb_per_s[on campus] = 0.0",
        ),
    ],
)
def test_params_are_validated(make: object, message: str) -> None:
    with pytest.raises(InvalidParams, match=message.replace("[", r"\[").replace("]", r"\]")):
        make()  # type: ignore[operator]


def test_params_follow_the_settings() -> None:
    settings = BrokerSettings(telemetry_interval_s=2.0, missed_intervals=4)
    assert PlacementParams.from_settings(settings).stale_after_s == 8.0
    assert FleetParams.from_settings(settings).forecast_horizon_s == 6.0
    assert dataclasses.replace(PARAMS, top_k=5).describe()["top_k"] == 5


def test_pool_demand_compares_arrivals_and_backlog_with_capacity() -> None:
    policy = campus_policy({NDC: ["gpu-1", "gpu-2"], SDC: ["npu-1"], "offsite/cloud-east": []})
    fleet = fleet_with(
        policy,
        [
            (caps("gpu-1", NDC, concurrency=2), {"queue_depth": 6, "capacity": 10}),
            (caps("gpu-2", NDC, concurrency=2), {"queue_depth": 0, "capacity": 10}),
            (caps("npu-1", SDC, device_class="ascend-910b"), {"queue_depth": 0}),
        ],
        params=FleetParams(forecast_horizon_s=2.0),
    )
    fleet.service.observe("defect-v1", "nvidia-a100", 10.0)  # 2 slots / 10 ms: 200 jobs/s
    fleet.mark_offline("npu-1", NOW)
    north, south = pool_demand(fleet, policy, arrivals_per_s={"pool-0": 150.0})
    assert (north.pool, north.zone, north.workers, north.online) == ("pool-0", NDC, 2, 2)
    assert north.capacity_jobs_s == pytest.approx(400.0)
    assert (north.slots, north.held, north.load) == (20, 6, 0.3)
    assert north.demand_jobs_s == pytest.approx(150.0 + 6 / 2.0)
    assert north.ratio == pytest.approx(153.0 / 400.0)
    assert north.desired_workers == math.ceil(153.0 / (200.0 * 0.7))
    assert (south.online, south.capacity_jobs_s, south.demand_jobs_s) == (0, 0.0, 0.0)
    assert south.desired_workers == 0
    busy = pool_demand(fleet, policy, arrivals_per_s={"pool-1": 10.0})[1]
    assert busy.ratio == math.inf
    assert busy.desired_workers == 1  # npu-1 would serve 2 jobs per 50 ms
    with pytest.raises(InvalidParams):
        pool_demand(fleet, policy, arrivals_per_s={}, target_utilisation=0.0)


def test_requests_turned_away_for_want_of_a_worker_wake_the_pools_they_could_reach() -> None:
    policy = policy_of(base_doc())  # wafers stay on campus; OCR crops may also go off site
    line = "campus/fab-north/line-1"
    turned_away = {
        ("wafer-image", line): 4,  # north-dc and south-dc: 2 each
        ("ocr-crop", line): 3,  # both data centres and the cloud: 1 each
        ("wafer-image", "offsite/nowhere"): 5,  # may go nowhere: counts for nothing
    }
    assert turned_away_per_pool(turned_away, policy) == pytest.approx(
        {"north-dc": 3.0, "south-dc": 3.0, "cloud": 1.0}
    )
    fleet = Fleet(FleetParams(), {}, policy)  # every pool scaled to zero
    assert all(d.desired_workers == 0 for d in pool_demand(fleet, policy, arrivals_per_s={}))
    params = ServiceParams()
    wafers = {("wafer-image", line): 4}
    arrivals = fold_arrivals({}, {}, wafers, policy, 1.0, params)
    assert arrivals == pytest.approx({"north-dc": 2.0, "south-dc": 2.0})
    desired = {
        d.pool: d.desired_workers for d in pool_demand(fleet, policy, arrivals_per_s=arrivals)
    }
    assert desired == {"north-dc": 1, "south-dc": 1, "cloud": 0}  # off site never wakes for wafers
    # Placements count as before, beside the refusals; a quiet tick lets the rate decay.
    both = fold_arrivals(arrivals, {"cloud": 3}, wafers, policy, 1.0, params)
    assert both["cloud"] == pytest.approx(3.0)
    assert both["north-dc"] == pytest.approx(2.0)
    quiet = fold_arrivals(both, {}, {}, policy, 1.0, params)
    assert 0.0 < quiet["north-dc"] < both["north-dc"]
    for _ in range(20):  # a long quiet: the rate falls under a job a minute, no worker wanted
        quiet = fold_arrivals(quiet, {}, {}, policy, 1.0, params)
    assert 0.0 < quiet["north-dc"] < 1.0 / 60.0
    assert all(d.desired_workers == 0 for d in pool_demand(fleet, policy, arrivals_per_s=quiet))
    assert fold_arrivals({}, {}, wafers, None, 1.0, params) == {}  # no policy: no pools
