"""Real tier, whole campus: a broker, two edge agents and two pool workers as processes
(the same :class:`LocalCampus` the demo runs), on real Mosquitto and Redis, secured as a
plant runs it: TLS, a certificate per node and app, the ACL generated from the policy, every
node's policy anchor pinned. Apps submit as themselves and take results on their own topics.

The burst test asserts completeness and placement; how many met their deadline is a
benchmark figure (bench/campus_burst.py), never a test assertion.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker import keys as broker_keys
from sluicegate.app.broker_http import get, get_json
from sluicegate.app.localcampus import LocalCampus, start_campus_mosquitto
from sluicegate.app.servers import free_port, running
from sluicegate.app.traffic import Tally, stream
from tests.policies.policy_testkit import key
from tests.support import local_campus, volley, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def campus(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[LocalCampus]:
    # Each campus gets its own Redis database, so reservations of other tests never count.
    with local_campus(
        tmp_path_factory.mktemp("local-campus"), fresh_redis_db(), log_level="info"
    ) as lc:
        yield lc


def test_burst_on_one_line_completes_and_stays_inside_the_policy(campus: LocalCampus) -> None:
    tally = Tally()

    async def run() -> None:
        await stream(
            campus.write(),
            10.0,
            11.5,
            asyncio.Event(),
            tally,
            burst_at=1.0,
            burst_for=10.0,
        )

    asyncio.run(run())
    submitted = sum(tally.submitted.values())
    assert submitted > 1000
    assert tally.answered == submitted  # every job ended in a result
    assert tally.errors == {}
    assert tally.unmatched == 0  # and in exactly one
    assert tally.kinds["pool"] > 0  # the burst really was offloaded
    assert tally.wafer_offsite == 0  # wafer images never left the campus
    assert set(tally.where) <= {"line-1-pc", "line-2-pc", "north-cpu-1", "cloud-cpu-1"}


def test_campus_only_class_with_only_offsite_capacity_runs_locally_and_says_why(
    campus: LocalCampus,
) -> None:
    # Freeze the campus worker: the broker sees it go silent, so the only idle worker left
    # is off-site, where a wafer image may not go.
    proc = campus.processes["north-cpu-1"]
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_for_fleet(campus, lambda ws: not ws["north-cpu-1"]["online"], timeout=15)
        # A generous deadline: the volley waits in a one-slot queue (more than queue_bound
        # jobs make the edge ask), and a loaded machine must not turn it into expiries.
        results = asyncio.run(volley(campus, "line-2-pc", 12, deadline_ms=10_000))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    wait_for_fleet(campus, lambda ws: ws["north-cpu-1"]["online"], timeout=15)
    assert all(r.status == "ok" for r in results), [(r.status, r.code) for r in results]
    assert all(r.ran_on.node == "line-2-pc" for r in results)
    asked = [r.offload for r in results if r.offload is not None]
    assert asked, "a volley of 12 on a one-slot edge must ask the broker"
    assert all(not o.placed for o in asked)
    assert {o.code for o in asked} <= {"no_worker", "no_capacity", "policy_denied"}


def test_placements_answered_after_the_edge_gave_up_free_their_slots_at_once(
    tmp_path: Path, fresh_redis_db: Callable[[], str]
) -> None:
    # An edge that waits 20 ms for the broker, and a broker frozen while the volley runs:
    # every request times out and its job runs locally. Thawed, the broker places them
    # all the same (they sat in its socket); the edge hands each late placement back, and
    # its slot is free long before its reservation would expire.
    # A campus and Mosquitto of its own: the module's campus uses the same node ids.
    db_url = fresh_redis_db()
    impatient = LocalCampus(
        tmp_path,
        mqtt_port=free_port(),
        redis_url=db_url,
        key_for=key,
        nodes=("broker-1", "line-1-pc", "north-cpu-1"),
        node_env={"line-1-pc": {"SLUICEGATE_OFFLOAD__PLACEMENT_TIMEOUT_MS": "20"}},
    )
    with running(start_campus_mosquitto(impatient.write())):
        impatient.start()
        try:
            wait_for_fleet(impatient, lambda ws: ws.get("north-cpu-1", {}).get("online"), 15)
            broker = impatient.processes["broker-1"]
            os.kill(broker.pid, signal.SIGSTOP)
            try:
                results = asyncio.run(volley(impatient, "line-1-pc", 12, deadline_ms=10_000))
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            assert all(r.status == "ok" for r in results)
            assert all(r.ran_on.node == "line-1-pc" for r in results)
            late = [r.job_id for r in results if r.offload and r.offload.code == "broker_timeout"]
            assert late, (
                "a volley of 12 on a one-slot edge with queue_bound 4 must ask",
                [(r.offload and (r.offload.code, r.offload.placed)) for r in results],
            )

            def settled() -> dict[str, str] | None:
                states = {job: _job(impatient, job).get("status", "") for job in late}
                return (
                    states if all(s in ("released", "refused") for s in states.values()) else None
                )

            states = wait_until(settled, timeout=15)
            released = [job for job, state in states.items() if state == "released"]
            assert released, states  # a free campus worker: the broker placed them
            held = redis.Redis.from_url(db_url).zrange(
                broker_keys.reservations("north-cpu-1"), 0, -1
            )
            assert not {j.decode() for j in held} & set(released)
            metrics = _get(impatient, "/metrics").decode()
            assert f"sluicegate_placements_released_total {float(len(released))}" in metrics
        finally:
            impatient.stop()


def _get(campus: LocalCampus, path: str) -> bytes:
    url = f"http://127.0.0.1:{campus.http_port}{path}"
    status, body = get(url, campus.campus.console_token("viewer"))
    assert status == 200, (path, status, body[:300])
    return body


def _job(campus: LocalCampus, job_id: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{campus.http_port}/jobs/{job_id}"
    status, body = get_json(url, campus.campus.console_token("viewer"))
    if status == 404:  # until the broker has decided it
        return {}
    assert status == 200, (status, body)
    return dict(body)


def wait_for_fleet(
    campus: LocalCampus, check: Callable[[dict[str, Any]], bool], timeout: float
) -> None:
    """Poll the broker's GET /fleet until ``check(workers by id)`` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = {w["id"]: w for w in json.loads(_get(campus, "/fleet"))["workers"]}
        if workers and check(workers):
            return
        time.sleep(0.1)  # the next poll of the broker's state
    raise AssertionError(f"fleet condition not met within {timeout} s")


def _older_defect_model(folder: Path) -> str:
    """defect-v1 as an earlier build: the same graph with other metadata, so another file
    (another sha256) under the same name. Returns its sha256."""
    import hashlib

    import onnx

    from sluicegate.vision.runtime import default_models_dir

    folder.mkdir()
    source = default_models_dir()
    model = onnx.load(str(source / "defect-v1.onnx"))
    onnx.helper.set_model_props(model, {"build": "an earlier one"})
    blob = model.SerializeToString()
    (folder / "defect-v1.onnx").write_bytes(blob)
    manifest = json.loads((source / "defect-v1.json").read_text())
    manifest |= {"version": "0.9.0", "sha256": hashlib.sha256(blob).hexdigest()}
    (folder / "defect-v1.json").write_text(json.dumps(manifest))
    return str(manifest["sha256"])


def test_a_worker_holding_another_version_never_gets_a_job_for_the_edges(
    tmp_path: Path, fresh_redis_db: Callable[[], str]
) -> None:
    # north-cpu-1 serves an earlier build of defect-v1; the edge and cloud-cpu-1 the current
    # one. A volley the edge cannot keep up with is offloaded (ocr-crop may go off-site),
    # and only ever to the worker holding the edge's very file.
    older = _older_defect_model(tmp_path / "older-models")
    mixed = LocalCampus(
        tmp_path / "campus",
        mqtt_port=free_port(),
        redis_url=fresh_redis_db(),
        key_for=key,
        nodes=("broker-1", "line-1-pc", "north-cpu-1", "cloud-cpu-1"),
        node_env={
            "north-cpu-1": {"SLUICEGATE_POOL__MODELS_DIR": str(tmp_path / "older-models")},
            # Which worker, not how fast: a loaded machine's slow answer must not keep the
            # volley on the edge.
            "line-1-pc": {"SLUICEGATE_OFFLOAD__PLACEMENT_TIMEOUT_MS": "2000"},
        },
    )
    with running(start_campus_mosquitto(mixed.write())):
        mixed.start()
        try:
            wait_for_fleet(
                mixed,
                lambda ws: all(ws.get(w, {}).get("online") for w in ("north-cpu-1", "cloud-cpu-1")),
                15,
            )
            held = {
                w: ws["capabilities"]["models"]
                for w, ws in _fleet(mixed).items()
                if w in ("north-cpu-1", "cloud-cpu-1")
            }
            assert f"defect-v1@{older}" in held["north-cpu-1"]
            assert f"defect-v1@{older}" not in held["cloud-cpu-1"]
            results = asyncio.run(
                volley(mixed, "line-1-pc", 40, data_class="ocr-crop", deadline_ms=10_000)
            )
            assert all(r.status == "ok" for r in results), [(r.status, r.code) for r in results]
            where = {r.ran_on.node for r in results}
            assert "north-cpu-1" not in where
            assert "cloud-cpu-1" in where, where  # offloaded, to the one with the edge's file
        finally:
            mixed.stop()


def _fleet(campus: LocalCampus) -> dict[str, Any]:
    return {w["id"]: w for w in json.loads(_get(campus, "/fleet"))["workers"]}
