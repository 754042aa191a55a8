"""Fault test, real processes: cut the line-1 edge's link to Mosquitto for longer than its
keepalive in the middle of a burst, then heal it; every job Mosquitto accepted ends in
exactly one result.

The edge reaches Mosquitto only through a :class:`~tests.faults.proxy.LinkProxy`. The cut is
a black hole (nothing passes, nothing closes), so Mosquitto learns of it only when the
edge's keepalive (5 s in the campus settings) expires and it publishes the edge's Last
Will; the test waits for that Will before healing, which proves the cut outlasted the
keepalive. Jobs published meanwhile are queued in the edge's persistent session.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.faults import check_exactly_once
from tests.faults.app import App, Observer, Timeline
from tests.faults.rig import Rig
from tests.faults.scenario import answered, run_fault

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

JOBS = 240  # 2 s of a 120 jobs/s burst at one edge

EDGE = "line-1-pc"


def _offline(timeline: Timeline, node: str) -> bool:
    return any(
        e.kind == "status" and e.node == node and e.detail == "offline" for e in timeline.events
    )


@pytest.mark.timeout(90)
def test_link_cut_longer_than_keepalive_then_heal(tmp_path: Path) -> None:
    will_seen: list[bool] = []
    with Rig(tmp_path, nodes=["broker-1", EDGE, "north-cpu-1"], edge_cpu=0.1, proxied=EDGE) as rig:
        proxy = rig.proxy
        assert proxy is not None

        async def cut_link(_app: App, obs: Observer) -> None:
            proxy.cut("blackhole")
            # Mosquitto gives up on the edge after 1.5 keepalives (7.5 s) and sends its Will.
            will_seen.append(await obs.wait_for(lambda tl: _offline(tl, EDGE), 15.0))
            proxy.heal()

        out = asyncio.run(run_fault(rig, cut_link, answered(20), jobs=JOBS))
    assert out.triggered, f"the burst never reached 20 results: {out.verdict.explain()}"
    assert will_seen == [True], "Mosquitto never published the edge's Last Will during the cut"
    check_exactly_once(out, rig, min_accepted=JOBS)
