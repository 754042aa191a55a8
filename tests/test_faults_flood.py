"""Fault test, real processes: an edge flooded with malformed requests keeps serving.

A smaller flood than ``bench/flood.py`` (300 requests/s for 3 s, every kind in
:data:`tests.faults.malformed.KINDS`) hits the line-1 edge while a vision app sends it 20
real jobs/s. Every real job must end in exactly one ``ok`` result, also those sent after
the flood, and the edge must have answered the flood with refusals. Memory and latency are
figures for the benchmark, never assertions here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.faults.flooding import flood_while_serving
from tests.faults.rig import Rig

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

EDGE = "line-1-pc"
LIMIT = 256 * 1024  # the edge's payload limit here, so near-limit payloads stay cheap


@pytest.mark.timeout(90)
def test_flood_of_malformed_requests_while_real_jobs_run(tmp_path: Path) -> None:
    env = {"SLUICEGATE_EDGE__MAX_PAYLOAD_BYTES": str(LIMIT)}
    with Rig(tmp_path, nodes=[EDGE], env=env, log_level="warning") as rig:
        report = asyncio.run(
            flood_while_serving(
                rig,
                edge=EDGE,
                flood_rate=300,
                flood_s=3.0,
                real_rate=20,
                before_s=1.0,
                after_s=1.0,
                payload_limit=LIMIT,
            )
        )
        alive = rig.campus.alive(EDGE)
    v = report.verdict
    print(
        f"flood: sent {sum(report.flood_sent.values())} {dict(report.flood_sent)}, refusals "
        f"{dict(report.refusals)}, real {v.explain()}, by phase {report.real_by_phase}, "
        f"latency {report.latency_ms}, edge RSS {report.rss_mib}"
    )
    assert alive, "the edge died under the flood"
    assert v.accepted == v.submitted, f"real jobs not accepted by Mosquitto: {v.explain()}"
    assert not v.lost, v.explain()
    assert not v.duplicated, v.explain()
    assert v.unexpected == 0, v.explain()
    assert dict(v.statuses) == {"ok": v.accepted}, v.explain()
    assert report.real_by_phase.get("after", 0) > 0  # the edge still served after the flood
    assert sum(report.refusals.values()) > 0, "the edge answered no malformed request"
