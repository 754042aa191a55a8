"""The work ahead on a worker, as placement prices it: the backlog its telemetry reports
drains as the clock runs, each job placed there since adds its model's service time
shared by the worker's slots, and a completed job is not subtracted a second time."""

from __future__ import annotations

import pytest

from broker.core.decision import Placed
from broker.core.fleet import Fleet
from broker.core.placement import decide
from tests.test_broker_core_kit import (
    NDC,
    NOW,
    PARAMS,
    campus_policy,
    caps,
    completion,
    fleet_with,
    request,
    telemetry,
)

POLICY = campus_policy()
DET = {"defect-v1": 40.0, "ocr-v1": 100.0}  # ms per job, as the worker reports them


def queue_ms(fleet: Fleet, at: float, model: str = "defect-v1") -> float:
    decision = decide(fleet, request(model=model), POLICY, now=at, params=PARAMS)
    assert isinstance(decision, Placed), decision
    return decision.candidates.ranked[0].queue_ms


def one_worker(**kw: object) -> Fleet:
    models = ("defect-v1", "ocr-v1")
    return fleet_with(POLICY, [(caps("gpu-1", NDC, models=models), {"service_ms": DET, **kw})])


def test_the_reported_backlog_drains_as_its_sample_ages() -> None:
    fleet = one_worker(queue_depth=2, backlog_ms=400.0)  # two slots: 200 ms each
    assert queue_ms(fleet, NOW) == pytest.approx(200.0)
    assert queue_ms(fleet, NOW + 0.15) == pytest.approx(50.0)
    assert queue_ms(fleet, NOW + 0.3) == 0.0


def test_a_placed_job_adds_its_own_models_time_shared_by_the_slots() -> None:
    fleet = one_worker()
    assert queue_ms(fleet, NOW) == 0.0
    fleet.reserve("gpu-1", "a", NOW, "defect-v1")
    assert queue_ms(fleet, NOW) == pytest.approx(20.0)
    fleet.reserve("gpu-1", "b", NOW, "ocr-v1")
    assert queue_ms(fleet, NOW) == pytest.approx(70.0)
    assert queue_ms(fleet, NOW + 0.03) == pytest.approx(40.0)
    # Placed on an idle worker later, a job starts when placed, not when the sample came.
    fleet.reserve("gpu-1", "c", NOW + 0.5, "defect-v1")
    assert queue_ms(fleet, NOW + 0.5) == pytest.approx(20.0)


def test_a_completed_job_is_not_subtracted_twice() -> None:
    fleet = one_worker()
    for job in "abcd":
        fleet.reserve("gpu-1", job, NOW, "defect-v1")
    assert queue_ms(fleet, NOW) == pytest.approx(80.0)
    for job in "ab":  # the first two finish at 40 ms, as the model said
        fleet.apply_completion(completion(job, "gpu-1", 40.0), NOW + 0.04)
    assert fleet.reserved("gpu-1") == 2  # held: the two still running
    assert queue_ms(fleet, NOW + 0.04) == pytest.approx(40.0)  # not 0: c and d run on


def test_a_job_that_went_elsewhere_leaves_the_work_ahead() -> None:
    fleet = one_worker()
    fleet.reserve("gpu-1", "a", NOW, "ocr-v1")
    fleet.reserve("gpu-1", "b", NOW, "defect-v1")
    assert fleet.release("a")
    assert queue_ms(fleet, NOW) == pytest.approx(20.0)


def test_telemetry_takes_over_from_what_was_placed_before_it() -> None:
    fleet = one_worker()
    for job in "abc":
        fleet.reserve("gpu-1", job, NOW, "ocr-v1")
    assert queue_ms(fleet, NOW) == pytest.approx(150.0)
    # The worker reports them 0.3 s later (absorbed: placed more than 0.25 s before it).
    fleet.apply_telemetry(
        telemetry("gpu-1", NOW + 0.3, queue_depth=1, backlog_ms=60.0, service_ms=DET), NOW + 0.3
    )
    assert queue_ms(fleet, NOW + 0.3) == pytest.approx(30.0)


def test_a_job_of_an_unreported_model_counts_at_the_workers_mean_job() -> None:
    fleet = one_worker(queue_depth=2, backlog_ms=200.0)  # mean job 100 ms
    fleet.reserve("gpu-1", "a", NOW, None)
    assert queue_ms(fleet, NOW) == pytest.approx(100.0 + 50.0)
