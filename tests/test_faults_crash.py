"""Fault tests, real processes: SIGKILL an edge mid-burst, a worker mid-batch, the broker
while it places; after each, every job Mosquitto accepted ends in exactly one result.

Each test runs a fresh campus (Mosquitto with persistence, Redis with an append-only file,
a broker, the line-1 edge capped to a tenth of a core so a burst offloads, and the campus
worker), bursts jobs with known ids at line 1, crashes one process at a moment chosen from
the campus's own traffic, and waits, bounded, for every result. No app-side resubmission:
a job the campus loses shows as lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults import check_exactly_once
from tests.faults.app import App, Observer, Timeline
from tests.faults.ledger import Ledger
from tests.faults.rig import Rig
from tests.faults.scenario import answered, run_fault

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

JOBS = 240  # 2 s of a 120 jobs/s burst at one edge

EDGE, WORKER, BROKER = "line-1-pc", "north-cpu-1", "broker-1"


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    """The campus, stopped before the test's checks run (see :func:`stopped`)."""
    # The worker gathers a batch for up to 50 ms (2 by default): on a fast machine it would
    # otherwise finish each offloaded job before the next came, and never hold a batch.
    gather = {"SLUICEGATE_POOL__BATCH_WINDOW_MS": "50"}
    with Rig(tmp_path, nodes=[BROKER, EDGE, WORKER], edge_cpu=0.1, env=gather) as rig:
        yield rig


def stopped(rig: Rig) -> Rig:
    """Stop the campus now, so a failure's diagnosis can read the edge's outbox."""
    rig.stop()
    return rig


@pytest.mark.timeout(90)
def test_control_burst_without_a_fault(rig: Rig) -> None:
    """The same burst with no fault: if this fails, the faults below prove nothing."""

    async def nothing(_app: App, _obs: Observer) -> None:
        return None

    out = asyncio.run(run_fault(rig, nothing, answered(20), jobs=JOBS))
    check_exactly_once(out, stopped(rig), min_accepted=JOBS)
    assert out.verdict.ran_on.keys() - {EDGE} or out.timeline.count("work"), (
        "nothing was offloaded: the burst did not load the edge enough to test the campus"
    )


@pytest.mark.timeout(90)
def test_edge_sigkill_mid_burst_then_restart(rig: Rig) -> None:
    async def crash_edge(_app: App, _obs: Observer) -> None:
        await asyncio.to_thread(rig.campus.kill, EDGE)
        await asyncio.to_thread(rig.campus.restart, EDGE)

    out = asyncio.run(run_fault(rig, crash_edge, answered(20), jobs=JOBS))
    assert out.triggered, f"the burst never reached 20 results: {out.verdict.explain()}"
    check_exactly_once(out, stopped(rig), min_accepted=JOBS)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("restart", [False, True], ids=["left-dead", "restarted"])
def test_worker_sigkill_mid_batch(rig: Rig, restart: bool) -> None:
    async def crash_worker(_app: App, _obs: Observer) -> None:
        await asyncio.to_thread(rig.campus.kill, WORKER)
        if restart:
            await asyncio.to_thread(rig.campus.restart, WORKER)

    def holds_a_batch(_ledger: Ledger, timeline: Timeline) -> bool:
        return in_flight(timeline, WORKER) >= 3

    out = asyncio.run(run_fault(rig, crash_worker, holds_a_batch, jobs=JOBS))
    assert out.triggered, f"the worker never held 3 jobs at once: {out.verdict.explain()}"
    check_exactly_once(out, stopped(rig), min_accepted=JOBS)


@pytest.mark.timeout(90)
def test_broker_sigkill_while_placing_then_restart(rig: Rig) -> None:
    async def crash_broker(_app: App, _obs: Observer) -> None:
        await asyncio.to_thread(rig.campus.kill, BROKER)
        await asyncio.to_thread(rig.campus.restart, BROKER)

    def placing(_ledger: Ledger, timeline: Timeline) -> bool:
        # Requests keep coming and the broker has answered some: it is mid-placement.
        return timeline.count("reply") >= 10 and timeline.count("request") > timeline.count("reply")

    out = asyncio.run(run_fault(rig, crash_broker, placing, jobs=JOBS))
    assert out.triggered, f"the broker was never seen placing: {out.verdict.explain()}"
    check_exactly_once(out, stopped(rig), min_accepted=JOBS)


def in_flight(timeline: Timeline, worker: str) -> int:
    """Jobs sent to ``worker`` that it has not reported complete."""
    sent = {e.job_id for e in timeline.events if e.kind == "work" and e.node == worker}
    done = {j for j, runs in timeline.completions.items() if any(run[0] == worker for run in runs)}
    return len(sent - done)
