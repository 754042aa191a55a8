"""A real broker (``broker.run.serve`` on real Mosquitto and Redis) under a policy whose
[rollout] requires twin verdicts: a placement file without one is not activated, the
broker serves on the parameters it held, says which over HTTP and writes the refusal to
its signed audit log; the same file with a passing verdict for its digest runs, and so
does the shipped learned placement policy once ``sluicegate twin verdict`` has passed it. And a
shadow candidate (policy and parameters) deciding beside production on live requests:
compared over HTTP, never acted on."""

from __future__ import annotations

import json
import queue
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.core.learned import FEATURES, LearnedPolicy, load, save
from broker.params_file import read_placement_file, verdict_path
from broker.run import serve
from policies.audit import decode_record
from policies.redis_stores import RedisStreamAuditStore, audit_stream_key
from sluicegate import topics
from sluicegate.app.broker_http import get_json, token_beside
from sluicegate.app.campus import Campus, write_campus
from sluicegate.app.servers import ServerProcess, free_port
from sluicegate.config import Settings, load_settings
from sluicegate.errors import ConfigError
from sluicegate.twin.rehearse import read_params
from tests.policies.policy_testkit import key
from tests.support import PlainClient, ServiceThread, params_verdict, twin, wait_until
from tests.test_broker_integration import WORKERS, ask
from tests.test_broker_integration import Fleet as WorkerPlayer

pytestmark = pytest.mark.integration

TWIN = key("twin-1")
ROLLOUT = f'[rollout]\nrequire_verdict = true\ntwin_keys = {{ twin-1 = "{TWIN.public_text}" }}\n'
SLOW_CAMPUS = "link_latency_ms = [0.2, 400.0, 0.0]\n"
SHIPPED = Path(__file__).resolve().parents[1] / "policies" / "placement" / "placement-v5.json"


def _get(settings: Settings, path: str) -> Any:
    url = f"http://127.0.0.1:{settings.broker.http_port}{path}"
    status, body = get_json(url, token_beside(settings.console.users_file), timeout=10)
    assert status == 200, (path, status, body)
    return body


def _run_broker(settings: Settings) -> ServiceThread:
    watcher = PlainClient(settings.mqtt.port)
    watcher.subscribe(topics.broker_status(settings.broker.id))
    thread = ServiceThread(lambda stop: serve(settings, stop, connect_timeout=10)).start()
    try:
        while b'"online"' not in watcher.next(timeout=20).payload:
            pass
    except queue.Empty:
        thread.stop()  # a broker that died at start: its error, not the watcher's
        raise
    watcher.close()
    return thread


def _known(settings: Settings, workers: WorkerPlayer, ids: tuple[str, ...]) -> None:
    """Announce ``ids`` as CPU workers and wait until the broker lists them online."""
    for worker in ids:
        workers.capabilities(worker, providers=["CPUExecutionProvider"])
        workers.telemetry(worker)

    def known() -> bool:
        listed = {w["id"]: w for w in _get(settings, "/fleet")["workers"]}
        return all(listed.get(w, {}).get("online") for w in ids)

    wait_until(known)


def _off_site_policy(placement: Path) -> Path:
    """A placement file naming, by its pinned sha256, a learned policy that wants off-site
    workers above all (version "away"), written beside it."""
    away = LearnedPolicy(
        tuple(-100.0 if f == "off_site" else 0.0 for f in FEATURES), version="away"
    )
    digest = save(away, placement.with_name("away.json"))
    placement.write_text(f'[learned]\nfile = "away.json"\nsha256 = "{digest}"\n')
    return placement


def _campus(
    root: Path, mosquitto: ServerProcess, url: str, **kw: Any
) -> tuple[redis.Redis, Campus]:
    """A plaintext demo campus on the test's Mosquitto and a Redis database of its own."""
    r = redis.Redis.from_url(url)
    made = write_campus(
        root, key, mqtt_port=mosquitto.port, redis_url=url, secure=False, confidential=False, **kw
    )
    return r, made


def test_a_gated_broker_runs_a_placement_file_only_with_its_verdict(
    tmp_path: Path, mosquitto: ServerProcess, fresh_redis_db: Callable[[], str]
) -> None:
    r, campus = _campus(tmp_path, mosquitto, fresh_redis_db(), rollout=ROLLOUT)
    placement = tmp_path / "placement.toml"
    placement.write_text(SLOW_CAMPUS)
    settings = load_settings(
        campus.node_config("broker-1"),
        broker={"http_port": free_port(), "placement_file": str(placement)},
    )
    thread = _run_broker(settings)
    try:
        shown = _get(settings, "/placement")
    finally:
        thread.stop()
    candidate = read_params(placement)
    assert shown["source"] == "settings"
    assert shown["params"]["link_latency_ms"] == [0.2, 0.5, 20.0]  # not the file's
    assert shown["refused"]["code"] == "verdict.missing"
    assert shown["refused"]["digest"] == candidate.digest()
    store = RedisStreamAuditStore(r, audit_stream_key("broker-1"))

    def refusals() -> list[dict[str, Any]]:
        records = [decode_record(e) for e in store.entries()]
        return [r.data for r in records if r.kind == "params.refused"]

    (audited,) = wait_until(refusals)
    decisions = json.loads(str(audited["decisions"]))
    assert decisions[0]["digest"] == candidate.digest()
    assert decisions[0]["code"] == "verdict.missing"

    verdict = params_verdict(candidate.digest(), TWIN)
    verdict_path(placement).write_text(verdict.model_dump_json())
    thread = _run_broker(settings)
    try:
        shown = _get(settings, "/placement")
    finally:
        thread.stop()
    assert shown["refused"] is None
    assert shown["source"] == str(placement)
    assert shown["params"]["link_latency_ms"] == [0.2, 400.0, 0.0]
    assert shown["digest"] == candidate.digest()


def test_a_shadow_candidate_decides_beside_production_and_never_acts(
    tmp_path: Path, mosquitto: ServerProcess, fresh_redis_db: Callable[[], str]
) -> None:
    _, campus = _campus(tmp_path, mosquitto, fresh_redis_db(), workers=WORKERS)
    # The candidate: a policy letting wafer images leave (unsigned: it never acts), and
    # parameters that make the off-site link free and the campus one slow.
    leaky = campus.policy_file.read_text().replace(
        'allow = ["campus/**"]\ndeny = ["offsite/**"]',
        'allow = ["campus/**", "campus/** -> offsite/cloud-east"]',
    )
    assert leaky != campus.policy_file.read_text()
    (tmp_path / "candidate.toml").write_text(leaky)
    (tmp_path / "candidate-placement.toml").write_text(
        "link_latency_ms = [0.2, 500.0, 0.0]\nlink_mb_per_s = [1000.0, 1.0, 1000000.0]\n"
    )
    settings = load_settings(
        campus.node_config("broker-1"),
        broker={
            "http_port": free_port(),
            "shadow_policy_file": str(tmp_path / "candidate.toml"),
            "shadow_placement_file": str(tmp_path / "candidate-placement.toml"),
        },
    )
    thread = _run_broker(settings)
    workers = WorkerPlayer(mosquitto.port)
    try:
        _known(settings, workers, ("north-a", "cloud-1"))
        replies = [ask(mosquitto, data_class="wafer-image") for _ in range(2)]
        shown = _get(settings, "/shadow")
    finally:
        workers.client.close()
        thread.stop()
    # Production kept both wafer images on campus, as the policy in force says ...
    assert [(p.status, p.worker_id) for p in replies] == [("placed", "north-a")] * 2
    # ... while the candidate would have sent both off site: moved, and forbidden.
    assert shown["decisions"] == 2
    assert shown["outcomes"]["moved"] == 2
    assert shown["moved"] == [{"production": "north-a", "candidate": "cloud-1", "jobs": 2}]
    assert shown["forbidden"] == [
        {"data_class": "wafer-image", "zone": "offsite/cloud-east", "jobs": 2}
    ]
    assert all(d["forbidden"] for d in shown["recent_differences"])
    assert "policy v1" in shown["candidate"]


def test_a_learned_placement_policy_in_the_placement_file_orders_what_the_rules_allow(
    tmp_path: Path, mosquitto: ServerProcess, fresh_redis_db: Callable[[], str]
) -> None:
    # A policy that wants off-site workers above all, pinned by its sha256 in the placement
    # file: ocr crops (allowed off site) go to the cloud worker the heuristic would pass
    # over; wafer images (campus only) still never leave.
    _, campus = _campus(tmp_path, mosquitto, fresh_redis_db(), workers=WORKERS)
    placement = _off_site_policy(tmp_path / "placement.toml")
    settings = load_settings(
        campus.node_config("broker-1"),
        broker={"http_port": free_port(), "placement_file": str(placement)},
    )
    thread = _run_broker(settings)
    workers = WorkerPlayer(mosquitto.port)
    try:
        _known(settings, workers, ("north-a", "cloud-1"))
        crop = ask(mosquitto, data_class="ocr-crop")
        wafer = ask(mosquitto, data_class="wafer-image")
        shown = _get(settings, "/placement")
    finally:
        workers.client.close()
        thread.stop()
    assert (crop.status, crop.worker_id) == ("placed", "cloud-1")
    assert (wafer.status, wafer.worker_id) == ("placed", "north-a")
    assert shown["params"]["learned"]["version"] == "away"
    assert shown["digest"] == read_params(placement).digest()
    # A placement file pinning another sha256 is a configuration error, named.
    placement.write_text('[learned]\nfile = "away.json"\nsha256 = "00"\n')
    with pytest.raises(ConfigError, match="pins '00'"):
        read_placement_file(placement)


def test_a_learned_policy_in_shadow_shows_what_it_would_move_in_shadow_and_the_console(
    tmp_path: Path, mosquitto: ServerProcess, fresh_redis_db: Callable[[], str]
) -> None:
    # Production runs the heuristic; the shadow candidate is a learned policy that prefers
    # off-site workers. An OCR crop (allowed off site) stays on campus in production and would
    # go to the cloud worker in the shadow: moved, never forbidden, never acted on; a wafer
    # image (campus only) stays where production puts it. Half agree, and the console shows
    # what /shadow serves.
    _, campus = _campus(tmp_path, mosquitto, fresh_redis_db(), workers=WORKERS)
    candidate = _off_site_policy(tmp_path / "candidate-placement.toml")
    settings = load_settings(
        campus.node_config("broker-1"),
        broker={"http_port": free_port(), "shadow_placement_file": str(candidate)},
    )
    thread = _run_broker(settings)
    workers = WorkerPlayer(mosquitto.port)
    try:
        _known(settings, workers, ("north-a", "cloud-1"))
        replies = [ask(mosquitto, data_class=c) for c in ("ocr-crop", "wafer-image")]
        served = _get(settings, "/shadow")
        shown = _get(settings, "/console/api/snapshot")["shadow"]
    finally:
        workers.client.close()
        thread.stop()
    assert [(r.status, r.worker_id) for r in replies] == [("placed", "north-a")] * 2
    assert (served["decisions"], served["agreement"]) == (2, 0.5)
    assert served["moved"] == [{"production": "north-a", "candidate": "cloud-1", "jobs": 1}]
    assert served["forbidden"] == []
    del served["recent_differences"]  # the console leaves them to /shadow
    assert shown == {**served, "moved_pairs": 1}


def test_the_shipped_learned_policy_runs_on_a_gated_broker_only_with_the_twins_verdict(
    tmp_path: Path, mosquitto: ServerProcess, fresh_redis_db: Callable[[], str]
) -> None:
    # The rollout path as a platform engineer walks it: the shipped policy, pinned in a
    # placement file, is refused by a broker whose policy requires verdicts; `twin verdict`
    # rehearses that very file on a trace and signs; the broker then runs it.
    _, campus = _campus(tmp_path, mosquitto, fresh_redis_db(), workers=WORKERS, rollout=ROLLOUT)
    manifest = SHIPPED.with_name(SHIPPED.name + ".sha256")
    for path in (SHIPPED, manifest):
        shutil.copy(path, tmp_path / path.name)
    digest = manifest.read_text().split()[0]
    placement = tmp_path / "placement.toml"
    placement.write_text(f'[learned]\nfile = "{SHIPPED.name}"\nsha256 = "{digest}"\n')
    settings = load_settings(
        campus.node_config("broker-1"),
        broker={"http_port": free_port(), "placement_file": str(placement)},
    )
    thread = _run_broker(settings)
    try:
        refused = _get(settings, "/placement")
    finally:
        thread.stop()
    assert refused["refused"]["code"] == "verdict.missing"
    assert "learned" not in refused["params"]  # it serves on the heuristic it held

    made = twin("synth", "--out", "t.jsonl.gz", "--seconds", "20", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    (tmp_path / "twin.key").write_bytes(TWIN.to_pem())
    signed = twin(
        "verdict",
        *("--trace", "t.jsonl.gz", "--burst", "2", "--key", "twin.key", "--key-id", "twin-1"),
        *("--params", "placement.toml", "--out", str(verdict_path(placement))),
        cwd=tmp_path,
    )
    assert signed.returncode == 0, signed.stdout + signed.stderr
    assert "passed" in signed.stdout

    thread = _run_broker(settings)
    workers = WorkerPlayer(mosquitto.port)
    try:
        _known(settings, workers, ("north-a", "cloud-1"))
        reply = ask(mosquitto, data_class="wafer-image")
        shown = _get(settings, "/placement")
    finally:
        workers.client.close()
        thread.stop()
    assert shown["refused"] is None
    assert shown["source"] == str(placement)
    assert shown["params"]["learned"] == load(SHIPPED).describe()
    assert (reply.status, reply.worker_id) == ("placed", "north-a")  # campus only, as ever
