"""In-memory tier: faults of the edge found by running it, each fixed in the lifecycle and
shown here against the real agent, a real SQLite outbox and the memory transport's
persistent sessions (tests/edge_kit.py steps the loop, the disk and compute).

* A refusal is acknowledged only once it is out: an agent killed after refusing a request
  but before the refusal reached the MQTT broker left the app unanswered and the request
  acked, so never delivered again.
* An offloaded job whose worker goes silent joins the local queue while a run here can
  still meet its deadline, instead of waiting for the fixed result timeout.
* A job that was placed, lost its worker and expired says so in its ``offload`` field.
* An offloaded job whose deadline came before its return said "no result from the pool
  within 3.0 s" when it had waited a fifth of that: it says it waited until its deadline.
* A job behind runs of a slower model was predicted as if each were a run of its own
  model; a detector job behind OCR runs then stayed here and expired. Each job ahead now
  weighs its own model's service time.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.edge_kit import EdgeRig

SERVICE_S = 0.3  # what a local run of the model takes, as the agent has measured it


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[EdgeRig]:
    loop = asyncio.new_event_loop()
    rig = EdgeRig(loop, tmp_path / "edge.db", offload=True, hold_pubacks=True)
    rig.start()
    assert rig.agent is not None
    rig.agent.service_times.observe("defect-v1", SERVICE_S)
    try:
        yield rig
    finally:
        rig.stop()
        loop.close()


def only_result(rig: EdgeRig) -> dict[str, Any]:
    (result,) = rig.results()
    return result


def test_a_refusal_is_acked_only_once_the_broker_has_it(rig: EdgeRig) -> None:
    assert rig.transport is not None
    rig.submit("r1", correlation=b"r1", model="defect-v9")
    rig.settle()
    assert [r["code"] for r in rig.results()] == ["unknown_model"]  # published ...
    assert len(rig.transport.unacked) == 1  # ... but not yet PUBACKed: the request waits
    rig.crash()  # killed now: the request is delivered again and refused again
    rig.start()
    rig.settle()
    assert [r["code"] for r in rig.results()] == ["unknown_model", "unknown_model"]
    assert len(rig.transport.unacked) == 1
    assert rig.broker.release_pubacks() == 1  # Mosquitto has this refusal: now it is acked
    rig.settle()
    assert rig.transport.unacked == []


def test_a_silent_workers_job_runs_here_while_its_deadline_can_still_be_met(
    rig: EdgeRig,
) -> None:
    agent, placement = rig.agent, rig.placement
    assert agent is not None
    assert placement is not None
    start = rig.clock.now
    rig.submit("s1", correlation=b"s1", deadline_ms=2000)
    rig.settle(compute=False)
    assert placement.sent == [("s1", 1)]  # on worker w1, which never answers
    rig.clock.now = start + 2.0 - SERVICE_S - 0.05  # not yet: the worker may still answer
    rig.call(agent.check_offloaded)
    assert agent.counters["offload_rescues"] == 0
    rig.clock.now = start + 2.0 - SERVICE_S + 0.01  # only a run here is in time now
    rig.call(agent.check_offloaded)
    rig.broker.release_pubacks()
    rig.settle()
    result = only_result(rig)
    assert (result["status"], result["ran_on"]["kind"]) == ("ok", "edge")
    assert result["offload"]["placed"] is True
    assert (result["offload"]["worker"], result["offload"]["code"]) == ("w1", "worker_silent")
    assert agent.counters["offload_rescues"] == 1
    rig.give_back("s1", 1)  # the worker wakes up: its result is one too many, dropped
    rig.settle()
    assert len(rig.results()) == 1


def test_a_job_that_would_have_to_start_here_before_its_worker_is_due_runs_only_there(
    rig: EdgeRig,
) -> None:
    # The worker is due 1.8 s after the placement; a run here (0.3 s) would have to start
    # by 1.7 s to meet the 2 s deadline. Starting one then would run every such job twice,
    # and the run here would take the job from the worker's return on time: no rescue.
    agent, placement = rig.agent, rig.placement
    assert agent is not None
    assert placement is not None
    placement.predicted_ms = 1800.0
    start = rig.clock.now
    rig.submit("d1", correlation=b"d1", deadline_ms=2000)
    rig.settle(compute=False)
    assert placement.sent == [("d1", 1)]
    rig.clock.now = start + 2.0 - SERVICE_S + 0.01  # the rescue moment of a silent worker
    rig.call(agent.check_offloaded)
    assert agent.counters["offload_rescues"] == 0
    rig.give_back("d1", 1)  # on time, as the broker predicted
    rig.broker.release_pubacks()
    rig.settle()
    result = only_result(rig)
    assert (result["status"], result["ran_on"]["kind"]) == ("ok", "pool")


def test_a_job_whose_worker_is_due_before_the_last_moment_to_run_here_is_still_rescued(
    rig: EdgeRig,
) -> None:
    agent, placement = rig.agent, rig.placement
    assert agent is not None
    assert placement is not None
    placement.predicted_ms = 500.0  # due long before 1.7 s: silence past then is a fault
    start = rig.clock.now
    rig.submit("d2", correlation=b"d2", deadline_ms=2000)
    rig.settle(compute=False)
    rig.clock.now = start + 2.0 - SERVICE_S + 0.01
    rig.call(agent.check_offloaded)
    assert agent.counters["offload_rescues"] == 1


def test_a_silent_workers_late_return_is_still_taken_before_the_run_here_starts(
    rig: EdgeRig,
) -> None:
    agent, placement = rig.agent, rig.placement
    assert agent is not None
    assert placement is not None
    busy = [f"busy-{n}" for n in range(1, 5)]
    placement.decline.update(busy)  # these run here
    start = rig.clock.now
    rig.submit("s2", correlation=b"s2", deadline_ms=2000)
    rig.settle(compute=False)
    for job_id in busy:  # every slot taken (two running, two started behind them): s2 waits
        rig.submit(job_id, correlation=job_id.encode())
    rig.settle(compute=False)
    rig.clock.now = start + 2.0 - SERVICE_S + 0.05  # rescued: into the (busy) local queue
    rig.call(agent.check_offloaded)
    assert agent.counters["offload_rescues"] == 1
    rig.give_back("s2", 1)  # the worker's result, before a slot frees up here
    rig.broker.release_pubacks()
    rig.settle()
    results = {r["job_id"]: r for r in rig.results()}
    assert results["s2"]["ran_on"]["kind"] == "pool"


def test_a_placed_job_that_lost_its_worker_and_expired_says_where_it_went(
    rig: EdgeRig,
) -> None:
    start = rig.clock.now
    rig.submit("x1", correlation=b"x1", deadline_ms=1000)
    rig.settle(compute=False)
    rig.clock.now = start + 1.5
    rig.notify("x1", 1)  # the worker died; the deadline has passed meanwhile
    rig.broker.release_pubacks()
    rig.settle()
    result = only_result(rig)
    assert result["status"] == "expired"
    offload = result["offload"]
    assert (offload["requested"], offload["placed"], offload["worker"]) == (True, True, "w1")
    # The lost worker, or (had the sweep looked first) the return not come by the deadline.
    assert offload["code"] in ("worker_lost", "result_timeout")
    assert "while it was offloaded" in result["reason"]


def test_an_offloaded_job_whose_deadline_came_first_says_so(rig: EdgeRig) -> None:
    agent = rig.agent
    assert agent is not None
    start = rig.clock.now
    rig.submit("t1", correlation=b"t1", deadline_ms=200)  # far less than result_timeout_s
    rig.settle(compute=False)
    rig.clock.now = start + 0.25  # no return by the deadline
    rig.call(agent.check_offloaded)
    rig.broker.release_pubacks()
    rig.settle()
    result = only_result(rig)
    assert result["status"] == "expired"
    offload = result["offload"]
    assert (offload["worker"], offload["code"]) == ("w1", "result_timeout")
    assert offload["reason"] == "no result from w1 by the job's deadline"


def test_the_prediction_error_of_jobs_run_here_is_in_telemetry(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    rig = EdgeRig(loop, tmp_path / "edge.db")  # nothing to offload to: every job runs here
    try:
        agent = rig.start()
        agent.service_times.observe("defect-v1", SERVICE_S)
        assert agent.telemetry().prediction is None  # nothing has run yet
        start = rig.clock.now
        rig.submit("p1", correlation=b"p1")  # predicted to finish at start + SERVICE_S
        rig.settle(compute=False)
        rig.clock.now = start + SERVICE_S + 0.2  # it finishes 200 ms later than that
        rig.settle()
        figures = agent.telemetry().prediction
        assert figures is not None
        assert figures.n == 1
        assert figures.bias_ms == pytest.approx(200.0, abs=1.0)
        assert figures.p50_ms == pytest.approx(200.0, abs=1.0)
    finally:
        rig.stop()
        loop.close()


def test_a_job_behind_a_slower_models_runs_is_predicted_to_wait_for_them(rig: EdgeRig) -> None:
    agent, placement = rig.agent, rig.placement
    assert agent is not None
    assert placement is not None
    agent.service_times.observe("reader-v1", 0.5)  # an OCR-like model: slower
    placement.decline |= {"o1", "o2"}  # both run here and hold the two slots
    rig.submit("o1", correlation=b"o1", model="reader-v1")
    rig.submit("o2", correlation=b"o2", model="reader-v1")
    rig.settle(compute=False)
    assert len(rig.executor.held) == 2  # both running, neither done
    rig.submit("d1", correlation=b"d1", deadline_ms=700)
    rig.settle(compute=False)
    # Two 0.5 s runs shared by two slots, then its own 0.3 s: 0.8 s, past its deadline (as
    # two runs of its own model ahead, 0.6 s, it would have stayed here and been late).
    reason, estimate_s = placement.reasons["d1"]
    assert reason == "deadline"
    assert estimate_s == pytest.approx(0.8, abs=0.01)


def test_a_request_is_acked_only_once_its_acceptance_is_on_the_disk(tmp_path: Path) -> None:
    """The run starts once the acceptance (its run counted) is written; the PUBACK waits
    for the sync behind it. With a log that cannot be synced the job runs, but its request
    is never acked (the broker delivers it again) and its result, whose commit cannot be
    made durable either, is never published; a synced edge beside it answers and acks."""
    seen = {}
    for name in ("synced", "unsynced"):
        loop = asyncio.new_event_loop()
        rig = EdgeRig(loop, tmp_path / name / "edge.db", synchronous="FULL")
        try:
            rig.start()
            assert rig.transport is not None
            if name == "unsynced":
                os.unlink(f"{rig.db}-wal")  # the log gone under SQLite: no sync can succeed
            rig.submit("d1", correlation=b"d1")
            rig.settle()
            agent = rig.agent
            assert agent is not None
            deadline = time.monotonic() + 10.0  # a slow disk syncs on a thread: its word
            while agent.unfinished or agent.delivering:  # comes back in a later tick
                assert time.monotonic() < deadline, "the job did not conclude"
                rig.settle()
            unacked = [m.correlation_data for m in rig.transport.unacked]
            seen[name] = ([r["status"] for r in rig.results()], unacked, rig.executor.ran)
        finally:
            rig.stop()
            loop.close()
    assert seen["synced"] == (["ok"], [], 1)
    assert seen["unsynced"] == ([], [b"d1"], 1)  # it ran: its count was written
