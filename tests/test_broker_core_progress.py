"""The fleet's watch on progress: a worker holding jobs that completes nothing long past
what their placements expected is suspect (no new placement until a sign of life), then
stalled (out of placement, its jobs placed again); completions and telemetry bring it
back, and a worker that keeps completing is never suspected."""

from __future__ import annotations

import pytest

from broker.core.decision import Placed
from broker.core.fleet import Fleet, Progress
from broker.core.params import FleetParams
from broker.core.placement import decide
from broker.errors import InvalidParams
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


def where(fleet: Fleet, now: float) -> str | None:
    decision = decide(fleet, request(), POLICY, now=now, params=PARAMS)
    return decision.worker_id if isinstance(decision, Placed) else None


def two_workers(*, warm: bool = True) -> Fleet:
    """gpu-1 (idle, chosen first) and npu-1 (busier), both online; ``warm``: gpu-1
    completed a job a moment ago (not starting cold), which taught no service time."""
    fleet = fleet_with(POLICY, [(caps("gpu-1", NDC), {}), (caps("npu-1", SDC), {})])
    fleet.apply_telemetry(telemetry("npu-1", NOW, zone=SDC, queue_depth=4), NOW)
    if warm:
        fleet.reserve("gpu-1", "warm-up", NOW - 0.2, "defect-v1", predicted_ms=10.0)
        failed = completion("warm-up", "gpu-1", 5.0).model_copy(update={"status": "failed"})
        fleet.apply_completion(failed, NOW - 0.195)
    assert where(fleet, NOW) == "gpu-1"
    return fleet


def test_a_job_overdue_makes_its_worker_suspect_until_its_next_completion() -> None:
    fleet = two_workers()
    fleet.reserve("gpu-1", "job-a", NOW, "defect-v1", predicted_ms=10.0)
    # Allowed: 3 x 10 ms, at least the 60 ms floor.
    assert fleet.check_progress(NOW + 0.05) == Progress()
    assert where(fleet, NOW + 0.05) == "gpu-1"
    assert fleet.check_progress(NOW + 0.07) == Progress(suspected=("gpu-1",))
    assert fleet.suspect("gpu-1")
    assert fleet.headroom("gpu-1") == 0
    assert where(fleet, NOW + 0.07) == "npu-1"  # no new placement there
    assert fleet.check_progress(NOW + 0.08) == Progress()  # suspected once
    fleet.apply_completion(completion("job-a", "gpu-1", 10.0), NOW + 0.09)
    assert not fleet.suspect("gpu-1")
    assert where(fleet, NOW + 0.09) == "gpu-1"


def test_telemetry_also_clears_a_suspicion() -> None:
    fleet = two_workers()
    fleet.reserve("gpu-1", "job-a", NOW, "defect-v1", predicted_ms=10.0)
    assert fleet.check_progress(NOW + 0.07).suspected == ("gpu-1",)
    fleet.apply_telemetry(telemetry("gpu-1", NOW + 0.1), NOW + 0.1)
    assert not fleet.suspect("gpu-1")
    assert fleet.headroom("gpu-1") > 0


def test_the_prediction_sets_how_long_a_job_may_take() -> None:
    fleet = two_workers()
    fleet.reserve("gpu-1", "slow", NOW, "defect-v1", predicted_ms=300.0)
    assert fleet.check_progress(NOW + 0.85) == Progress()
    assert fleet.check_progress(NOW + 0.91).suspected == ("gpu-1",)


def test_without_a_prediction_the_models_service_time_there_stands_in() -> None:
    fleet = two_workers()
    fleet.apply_completion(completion("before", "gpu-1", 100.0), NOW)  # learned: 100 ms
    fleet.reserve("gpu-1", "job-a", NOW, "defect-v1")
    assert fleet.check_progress(NOW + 0.29) == Progress()
    assert fleet.check_progress(NOW + 0.31).suspected == ("gpu-1",)


def test_a_worker_that_keeps_completing_is_never_suspect() -> None:
    fleet = two_workers()
    for i in range(20):  # a queue of 20 jobs, one done every 40 ms: each after its turn
        fleet.reserve("gpu-1", f"job-{i}", NOW, "defect-v1", predicted_ms=10.0)
    for i in range(20):
        now = NOW + 0.04 * (i + 1)
        assert fleet.check_progress(now - 0.001) == Progress(), i
        fleet.apply_completion(completion(f"job-{i}", "gpu-1", 10.0), now)
    assert not fleet.suspect("gpu-1")


def test_a_silent_worker_stalls_and_comes_back_with_its_next_completion() -> None:
    fleet = two_workers()
    fleet.reserve("gpu-1", "job-a", NOW, "defect-v1", predicted_ms=10.0)
    fleet.reserve("gpu-1", "job-b", NOW + 0.01, "defect-v1", predicted_ms=20.0)
    assert fleet.check_progress(NOW + 0.07).suspected == ("gpu-1",)
    # Stalled: silent past 3 x its next batch (2 jobs at the 50 ms default), 0.3 s.
    assert fleet.stall_after("gpu-1") == pytest.approx(0.3)
    assert fleet.check_progress(NOW + 0.29).stalled == ()
    assert fleet.check_progress(NOW + 0.31).stalled == ("gpu-1",)
    assert fleet.mark_stalled("gpu-1", NOW + 0.31) == ("job-a", "job-b")
    state = fleet.state("gpu-1")
    assert state is not None
    assert not state.online
    assert fleet.check_progress(NOW + 0.5) == Progress()  # offline: not looked at again
    assert where(fleet, NOW + 0.5) == "npu-1"
    # The thawed worker answers its stale work: alive, back in placement at once.
    fleet.apply_completion(completion("job-a", "gpu-1", 10.0), NOW + 3.0)
    state = fleet.state("gpu-1")
    assert state is not None
    assert state.online
    assert fleet.headroom("gpu-1") > 0


def test_a_last_will_is_not_undone_by_a_late_completion() -> None:
    fleet = two_workers()
    fleet.reserve("gpu-1", "job-a", NOW, "defect-v1", predicted_ms=10.0)
    fleet.mark_offline("gpu-1", NOW + 0.01)
    fleet.apply_completion(completion("job-a", "gpu-1", 10.0), NOW + 0.02)
    state = fleet.state("gpu-1")
    assert state is not None
    assert not state.online


def test_a_worker_starting_cold_may_take_longer_for_its_first_completion() -> None:
    fleet = two_workers(warm=False)  # never completed a job
    fleet.reserve("gpu-1", "job-a", NOW, "defect-v1", predicted_ms=10.0)
    assert fleet.check_progress(NOW + 0.29) == Progress()
    assert fleet.check_progress(NOW + 0.31).suspected == ("gpu-1",)
    fleet.apply_completion(completion("job-a", "gpu-1", 10.0), NOW + 0.32)
    # Busy again within idle_after_s (1 s): warm, its own pace (0.32 s lately) applies.
    fleet.reserve("gpu-1", "job-b", NOW + 0.5, "defect-v1", predicted_ms=10.0)
    assert fleet.check_progress(NOW + 0.5 + 0.05) == Progress()
    # Idle for more than a second, then a volley: cold again.
    fleet.apply_completion(completion("job-b", "gpu-1", 10.0), NOW + 0.6)
    fleet.reserve("gpu-1", "job-c", NOW + 5.0, "defect-v1", predicted_ms=10.0)
    assert fleet.check_progress(NOW + 5.25) == Progress()
    assert fleet.check_progress(NOW + 5.31).suspected == ("gpu-1",)


def test_progress_params_are_validated() -> None:
    with pytest.raises(InvalidParams, match="stall_factor"):
        FleetParams(stall_factor=0.5)
    with pytest.raises(InvalidParams, match="stall_floor_s"):
        FleetParams(stall_floor_s=0.0)


def test_a_worker_slower_than_predicted_sets_its_own_pace() -> None:
    fleet = two_workers()
    fleet.reserve("gpu-1", "job-a", NOW, "defect-v1", predicted_ms=10.0)
    assert fleet.check_progress(NOW + 0.07).suspected == ("gpu-1",)
    fleet.apply_completion(completion("job-a", "gpu-1", 10.0), NOW + 0.2)  # silent 200 ms
    assert fleet.usual_silence("gpu-1", NOW + 0.2) == pytest.approx(0.2)
    # Its next job may take about three times that (fading) before it is suspect again...
    fleet.reserve("gpu-1", "job-b", NOW + 0.2, "defect-v1", predicted_ms=10.0)
    assert fleet.check_progress(NOW + 0.6) == Progress()
    assert fleet.check_progress(NOW + 0.85).suspected == ("gpu-1",)
    # ... and the memory of a slow spell fades (halved every 2 s).
    assert fleet.usual_silence("gpu-1", NOW + 2.2) == pytest.approx(0.1)
