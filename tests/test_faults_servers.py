"""Fault tests, real processes: restart Redis (SIGKILL; append-only file, fsync always) and
Mosquitto (graceful stop with persistence) in the middle of a burst; every job Mosquitto
accepted ends in exactly one result.

The campus is the crash tests' (broker, the line-1 edge capped to a tenth of a core, the
campus worker). Mosquitto keeps sessions and their queued messages on disk, and every
client here (the edge, the app) uses a persistent session, so what was queued for a client
is still queued for it after the restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.faults import check_exactly_once
from tests.faults.app import App, Observer
from tests.faults.rig import Rig
from tests.faults.scenario import answered, run_fault, seen

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

JOBS = 240  # 2 s of a 120 jobs/s burst at one edge

NODES = ["broker-1", "line-1-pc", "north-cpu-1"]


@pytest.mark.timeout(90)
def test_redis_sigkill_and_restart_mid_burst(tmp_path: Path) -> None:
    with Rig(tmp_path, nodes=NODES, edge_cpu=0.1, appendfsync="always") as rig:

        async def crash_redis(_app: App, _obs: Observer) -> None:
            await asyncio.to_thread(rig.campus.restart, "redis", kill=True)

        # The broker has answered placements: it is using Redis when it dies.
        out = asyncio.run(run_fault(rig, crash_redis, seen("reply", 5), jobs=JOBS))
    assert out.triggered, f"no placement was answered: {out.verdict.explain()}"
    check_exactly_once(out, rig, min_accepted=JOBS)


@pytest.mark.timeout(90)
def test_mosquitto_graceful_restart_mid_burst(tmp_path: Path) -> None:
    with Rig(tmp_path, nodes=NODES, edge_cpu=0.1) as rig:

        async def restart_mosquitto(_app: App, _obs: Observer) -> None:
            await asyncio.to_thread(rig.campus.restart, "mosquitto")

        out = asyncio.run(run_fault(rig, restart_mosquitto, answered(20), jobs=JOBS))
    assert out.triggered, f"the burst never reached 20 results: {out.verdict.explain()}"
    check_exactly_once(out, rig, min_accepted=JOBS)
