"""The link between two campuses cut mid-burst and restored (issue 39): nothing lost, nothing
twice. North's line PC sends part of a burst to south's pool; the bridge's link is cut while
jobs are out there; their results cannot come, so north's broker, told by Mosquitto that its
bridge is down, sends each back to the line PC at once as a lost worker's (re-placed or run
there, well before its result would be overdue), and whatever south still returns once the
link is back (the bridge's session holds it) is fenced as a stale attempt. Two whole
campuses as processes (``tests/two_campus_kit.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from sluicegate import topics, wire
from sluicegate.app.campus import OBSERVER
from sluicegate.client import AsyncClient
from sluicegate.mqtt.bridge import MqttTransport
from sluicegate.transport import Message
from tests.image_bytes import sample_jpeg
from tests.two_campus_kit import SOUTH_DC, TwoCampuses, two_campuses

pytestmark = [pytest.mark.integration, pytest.mark.faults]

LINE, APP, RESULTS = "line-1-pc", "app-line-1", "app/line-1/results"
JPEG, _TRUTH = sample_jpeg(9)


@pytest.fixture(scope="module")
def rig(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[TwoCampuses]:
    env = {"SLUICEGATE_OFFLOAD__PLACEMENT_TIMEOUT_MS": "500"}
    env["SLUICEGATE_OFFLOAD__RESULT_TIMEOUT_S"] = "10.0"  # the notice, not this, moves them
    with two_campuses(
        tmp_path_factory.mktemp("cut"),
        fresh_redis_db,
        north_nodes=("broker-1", LINE),
        south_nodes=("broker-1", "north-cpu-1"),
        delay_s=0.005,
        north_env={LINE: env},
    ) as made:
        yield made


async def burst_through_a_cut(
    rig: TwoCampuses, jobs: int
) -> tuple[list[wire.JobResult], int, dict[str, int]]:
    """The burst; the link cut once a first job came back from south, mended once a job
    ran on the line PC after the cut. Returns the results, the app's count of results it
    got twice, and the line PC's event counts once it has counted a lost worker."""
    north = rig.north.campus
    assert north is not None
    seen: dict[str, int] = {}
    lost = asyncio.Event()

    def heard(msg: Message) -> None:
        seen.update(wire.EdgeTelemetry.model_validate_json(msg.payload).events)
        if seen.get("workers_lost", 0) > 0:
            lost.set()

    watcher = MqttTransport(north.mqtt(OBSERVER), client_id=OBSERVER)
    async with (
        watcher,
        AsyncClient(north.mqtt(APP), edge=LINE, response_topic=RESULTS, default_timeout=90) as app,
    ):
        await watcher.subscribe(topics.edge_telemetry(LINE), heard)
        calls = [
            asyncio.ensure_future(
                app.infer(JPEG, model="defect-v1", data_class="ocr-crop", deadline_ms=20_000)
            )
            for _ in range(jobs)
        ]
        pending = set(calls)
        cut = False
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            zones = {task.result().ran_on.zone for task in done}
            if not cut and SOUTH_DC in zones:
                rig.relay.cut()
                cut = True
            elif cut and any(task.result().ran_on.kind == "edge" for task in done):
                rig.relay.mend()
        results = [task.result() for task in calls]
        await asyncio.wait_for(lost.wait(), timeout=30)
        return results, app.duplicates + app.unmatched, seen


def test_a_link_cut_mid_burst_loses_nothing_and_answers_each_job_once(rig: TwoCampuses) -> None:
    rig.wait_offered()
    results, twice, events = asyncio.run(burst_through_a_cut(rig, 40))
    assert [r.status for r in results] == ["ok"] * len(results), [
        (r.status, r.code, r.reason) for r in results if r.status != "ok"
    ]
    assert len({r.job_id for r in results}) == len(results)
    assert twice == 0  # no job answered twice, however late south's returns came
    where = {r.ran_on.kind + ":" + r.ran_on.zone for r in results}
    assert f"pool:{SOUTH_DC}" in where  # some went across before the cut
    assert any(w.startswith("edge:") for w in where)  # and some ran here
    # Those out there at the cut came back as a lost worker's, told by north's broker.
    assert events["workers_lost"] >= 1
