"""Real tier: the console on a real broker replica (real Mosquitto and Redis; workers played
by MQTT publishers, as in ``test_broker_integration``): who may see and do what, operators'
holds changing real placements, the live stream, a job's story and the audit records.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from broker.console.routes import COOKIE
from broker.run import serve  # noqa: F401  (the broker fixture's module imports it)
from sluicegate.app.broker_http import get, get_json, post_json, token_beside
from sluicegate.app.servers import ServerProcess
from sluicegate.config import Settings
from tests.secure_kit import audit_records
from tests.support import ServiceThread, wait_until
from tests.test_broker_integration import WORKERS, Fleet, ask, broker, campus, campus_redis, fleet

# Fixtures, shared with the broker's own tests.
__all__ = ["broker", "campus", "campus_redis", "fleet"]
pytestmark = pytest.mark.integration
DC = ("north-a", "north-b", "north-gpu")  # the workers a campus-only class may use


def _url(settings: Settings, path: str) -> str:
    return f"http://127.0.0.1:{settings.broker.http_port}{path}"


def _token(settings: Settings, role: str) -> str:
    token = token_beside(settings.console.users_file, role)
    assert token is not None
    return token


def _act(settings: Settings, role: str, action: str, target: str, **extra: Any) -> Any:
    body = {"action": action, "target": target, **extra}
    return post_json(_url(settings, "/console/api/actions"), _token(settings, role), body)


def _online(fleet: Fleet, settings: Settings) -> None:
    for worker in WORKERS:
        fleet.capabilities(worker, providers=["CPUExecutionProvider"])
        fleet.telemetry(worker)
    viewer = _token(settings, "viewer")
    wait_until(
        lambda: (
            sum(w["online"] for w in get_json(_url(settings, "/fleet"), viewer)[1]["workers"])
            == len(WORKERS)
        )
    )


@pytest.fixture
def held(broker: tuple[ServiceThread, Settings]) -> Iterator[Settings]:
    """The broker's settings; every hold lifted afterwards, so tests stay independent."""
    settings = broker[1]
    yield settings
    snapshot = get_json(_url(settings, "/console/api/snapshot"), _token(settings, "viewer"))[1]
    for hold in snapshot["holds"]:
        verb = "resume" if hold["kind"] == "pause" else "uncordon"
        assert _act(settings, "operator", verb, hold["target"])[0] == 200


def test_nothing_is_anonymous_but_health_metrics_and_the_login_page(held: Settings) -> None:
    for path in ("/fleet", "/jobs/x", "/dead-letters", "/policy", "/console/api/snapshot"):
        status, body = get_json(_url(held, path), None)
        assert status == 401, path
        assert "Authorization: Bearer" in body["error"]
    health = get_json(_url(held, "/health"), None)
    assert health[0] in (200, 503)  # ready or not: it says so to anyone
    assert "ready" in health[1]
    assert get(_url(held, "/metrics"), None)[0] == 200
    assert b"Log in" in get(_url(held, "/console/login"), None)[1]
    conn = http.client.HTTPConnection("127.0.0.1", held.broker.http_port, timeout=5)
    conn.request("GET", "/console")
    page = conn.getresponse()
    assert (page.status, page.getheader("Location")) == (303, "/console/login")
    conn.close()
    # A token that is not on the list is no better than none.
    assert get_json(_url(held, "/fleet"), "sgc_not-a-token")[0] == 401


def test_a_viewer_sees_everything_and_cannot_act(held: Settings, fleet: Fleet) -> None:
    _online(fleet, held)
    viewer = _token(held, "viewer")
    status, me = get_json(_url(held, "/console/api/whoami"), viewer)
    assert (status, me["role"]) == (200, "viewer")
    snap = get_json(_url(held, "/console/api/snapshot"), viewer)[1]
    ids = {w["id"] for zone in snap["zones"].values() for w in zone["workers"]}
    assert ids == set(WORKERS)
    assert snap["compliance"]["policy"]["campus"] == "demo-campus"
    status, body = _act(held, "viewer", "cordon", "north-a")
    assert status == 403
    assert "viewer" in body["error"]
    assert not get_json(_url(held, "/console/api/snapshot"), viewer)[1]["holds"]


def test_without_a_shadow_candidate_the_console_shows_none(
    held: Settings, fleet: Fleet, mosquitto: ServerProcess
) -> None:
    _online(fleet, held)
    assert ask(mosquitto).status == "placed"  # production decided; nothing was compared
    viewer = _token(held, "viewer")
    assert get_json(_url(held, "/shadow"), viewer)[0] == 404
    snap = get_json(_url(held, "/console/api/snapshot"), viewer)[1]
    assert "shadow" in snap
    assert snap["shadow"] is None


def test_bad_actions_get_a_clear_error_and_change_nothing(held: Settings) -> None:
    url, operator = _url(held, "/console/api/actions"), _token(held, "operator")
    cases = [
        ({"action": "cordon", "target": "nobody"}, 404, "no worker 'nobody'"),
        ({"action": "pause", "target": "north-a"}, 404, "no line PC (edge) 'north-a'"),
        ({"action": "explode", "target": "north-a"}, 400, "action"),
        ({"action": "cordon"}, 400, "target"),
        ({"action": "cordon", "target": "north-a", "extra": 1}, 400, "extra"),
        ({"action": "uncordon", "target": "north-a"}, 409, "is not drained or cordoned"),
        ({"action": "resume", "target": "line-1-pc"}, 409, "is not paused"),
    ]
    for body, status, words in cases:
        got, answer = post_json(url, operator, body)
        assert got == status, (body, answer)
        assert words in answer["error"], (body, answer)
    conn = http.client.HTTPConnection("127.0.0.1", held.broker.http_port, timeout=5)
    conn.request(
        "POST",
        "/console/api/actions",
        body=b"action=cordon&target=north-a",
        headers={
            "Authorization": f"Bearer {operator}",
            "Content-Type": "application/x-www-form-urlencoded",
        },
    )
    assert conn.getresponse().status == 415
    conn.close()
    snap = get_json(_url(held, "/console/api/snapshot"), operator)[1]
    assert snap["holds"] == []


def test_cordoned_workers_get_no_placements_until_lifted_and_it_isaudit_records(
    held: Settings, fleet: Fleet, mosquitto: ServerProcess, campus_redis: str
) -> None:
    _online(fleet, held)
    assert ask(mosquitto).status == "placed"
    for worker in DC:
        status, body = _act(held, "operator", "cordon", worker, note="maintenance")
        assert status == 200, body
    again = _act(held, "operator", "cordon", "north-a")
    assert again[0] == 409
    refused = ask(mosquitto)
    assert (refused.status, refused.code) == ("refused", "no_worker")
    assert "3 are cordoned by an operator" in (refused.reason or "")
    snap = get_json(_url(held, "/console/api/snapshot"), _token(held, "viewer"))[1]
    shown = {w["id"]: w["hold"] for zone in snap["zones"].values() for w in zone["workers"]}
    assert {w: shown[w] for w in DC} == dict.fromkeys(DC, "cordon")
    assert _act(held, "operator", "uncordon", "north-b")[0] == 200
    placed = ask(mosquitto)
    assert (placed.status, placed.worker_id) == ("placed", "north-b")
    records = audit_records(campus_redis, "operator.cordon")
    cordoned = [json.loads(r["decisions"])[0] for r in records]
    assert {(c["target"], c["by"], c["note"]) for c in cordoned} >= {
        (w, "operator", "maintenance") for w in DC
    }
    assert audit_records(campus_redis, "operator.uncordon")


def test_a_drained_worker_shows_drained_once_it_holds_no_job(
    held: Settings, fleet: Fleet, mosquitto: ServerProcess
) -> None:
    _online(fleet, held)
    assert _act(held, "operator", "drain", "north-gpu")[0] == 200
    fleet.telemetry("north-gpu", queue=2)
    viewer = _token(held, "viewer")

    def gpu() -> dict[str, Any]:
        snap = get_json(_url(held, "/console/api/snapshot"), viewer)[1]
        workers = [w for zone in snap["zones"].values() for w in zone["workers"]]
        return next(w for w in workers if w["id"] == "north-gpu")

    wait_until(lambda: gpu()["jobs_held"] == 2)
    assert (gpu()["hold"], gpu()["drained"]) == ("drain", False)
    fleet.telemetry("north-gpu", queue=0)
    wait_until(lambda: gpu()["drained"])
    for _ in range(5):  # never placed there while drained
        reply = ask(mosquitto)
        assert reply.worker_id != "north-gpu"


def test_pausing_a_line_keeps_its_jobs_local_with_the_reason(
    held: Settings, fleet: Fleet, mosquitto: ServerProcess
) -> None:
    _online(fleet, held)
    assert _act(held, "operator", "pause", "line-1-pc", note="camera swap")[0] == 200
    reply = ask(mosquitto)
    assert (reply.status, reply.code) == ("refused", "offload_paused")
    assert reply.reason == "offload from line-1-pc paused by operator: camera swap"
    assert ask(mosquitto, edge="line-2-pc").status == "placed"  # the other line is untouched
    assert _act(held, "operator", "resume", "line-1-pc")[0] == 200
    assert ask(mosquitto).status == "placed"


def test_a_login_gives_a_session_a_forged_one_is_refused(held: Settings) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", held.broker.http_port, timeout=5)
    form = f"name=&password={_token(held, 'viewer')}"
    conn.request(
        "POST",
        "/console/login",
        body=form.encode(),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    answer = conn.getresponse()
    assert (answer.status, answer.getheader("Location")) == (303, "/console")
    cookie = answer.getheader("Set-Cookie") or ""
    assert "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    answer.read()
    value = cookie.split(";")[0].split("=", 1)[1].strip('"')

    def whoami(session: str) -> int:
        conn.request("GET", "/console/api/whoami", headers={"Cookie": f"{COOKIE}={session}"})
        got = conn.getresponse()
        got.read()
        return got.status

    assert whoami(value) == 200
    forged = value.replace("|viewer|", "|operator|")
    assert whoami(forged) == 401
    conn.request(
        "POST",
        "/console/login",
        body=b"name=viewer&password=wrong",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    failed = conn.getresponse()
    failed.read()
    assert (failed.status, failed.getheader("Location")) == (303, "/console/login?failed=1")
    conn.close()


def test_the_live_stream_pushes_snapshots(held: Settings, fleet: Fleet) -> None:
    _online(fleet, held)
    conn = http.client.HTTPConnection("127.0.0.1", held.broker.http_port, timeout=10)
    conn.request(
        "GET", "/console/api/events", headers={"Authorization": f"Bearer {_token(held, 'viewer')}"}
    )
    stream = conn.getresponse()
    assert stream.status == 200
    assert stream.getheader("Content-Type", "").startswith("text/event-stream")
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        line = stream.readline()
        if line.startswith(b"data: "):
            seen.append(json.loads(line[6:]))
    conn.close()
    assert len(seen) == 2
    assert seen[1]["now"] > seen[0]["now"]
    assert {w["id"] for z in seen[1]["zones"].values() for w in z["workers"]} == set(WORKERS)


def test_a_jobs_story_has_its_decision_candidates_and_audit_record(
    held: Settings, fleet: Fleet, mosquitto: ServerProcess
) -> None:
    _online(fleet, held)
    reply = ask(mosquitto)
    assert reply.status == "placed"
    viewer = _token(held, "viewer")
    url = _url(held, f"/console/api/jobs/{reply.job_id}")

    def story() -> dict[str, Any] | None:
        # The decision's record and its audit record are separate writes (the store's
        # batch and the audit log's), in either order: wait for both.
        status, body = get_json(url, viewer)
        whole = status == 200 and body["audit"] and "why" in (body["placement"] or {})
        return body if whole else None

    found = wait_until(story)
    ranked = found["placement"]["why"]["candidates"]["ranked"]
    assert ranked[0]["worker_id"] == reply.worker_id
    assert {"transfer_ms", "queue_ms", "service_ms", "score_ms"} <= set(ranked[0])
    assert found["audit"][0]["kind"] == "placements"
    assert found["audit"][0]["entries"][0]["job_id"] == reply.job_id
    assert found["path"][0].startswith(f"placed on {reply.worker_id}")
    status, body = get_json(_url(held, "/console/api/jobs/never-seen"), viewer)
    assert status == 404
    assert "never-seen" in body["error"]


def test_past_the_limit_of_live_streams_a_dashboard_is_told_to_poll(
    held: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("broker.console.routes.MAX_STREAMS", 2)
    viewer = _token(held, "viewer")
    auth = {"Authorization": f"Bearer {viewer}"}
    snapshot = _url(held, "/console/api/snapshot")
    # A stream another test closed ends when the broker next writes to it (within a second).
    wait_until(lambda: get_json(snapshot, viewer)[1]["watching"] == 0)
    opened = []
    for _ in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", held.broker.http_port, timeout=10)
        conn.request("GET", "/console/api/events", headers=auth)
        answer = conn.getresponse()
        assert answer.status == 200
        assert answer.readline().startswith(b"event: snapshot")  # it is being served
        opened.append(conn)
    status, body = get_json(_url(held, "/console/api/events"), _token(held, "viewer"))
    assert status == 503
    assert "poll /console/api/snapshot" in body["error"]
    for conn in opened:
        conn.close()
