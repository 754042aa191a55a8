"""The console's pure parts: who a caller is (passwords, tokens, sessions, the users file),
what an operator's action changes, and the figures the dashboard shows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from broker.console.auth import (
    Sessions,
    Users,
    Who,
    add_entry,
    check_password,
    default_users,
    hash_password,
    new_token,
    token_digest,
)
from broker.console.figures import (
    Window,
    bin_of,
    class_matrix,
    may_run,
    node_zone,
    percentile,
    words_for,
)
from broker.console.holds import Action, ActionRefused, Hold, act, cordoned, paused
from broker.console.snapshot import MOVES_SHOWN, shadow_section
from broker.core.params import FleetParams, PlacementParams
from broker.core.shadow import Compared, Shadow
from broker.view import shadow_facts
from sluicegate import wire
from sluicegate.errors import ConfigError
from sluicegate.wire_pool import Completion
from tests.policies.policy_testkit import PARTS_TERMS, policy_of, site_doc

WORKERS = ("north-a", "north-b")
EDGES = ("line-1-pc",)


def test_a_password_checks_only_against_its_own_hash() -> None:
    stored = hash_password("correct horse battery")
    assert stored.startswith("scrypt$")
    assert check_password("correct horse battery", stored)
    assert not check_password("correct horse batterY", stored)
    assert not check_password("x", "scrypt$broken")
    assert not check_password("x", "md5$1$2$3$4$5")
    assert hash_password("same") != hash_password("same")  # salted


def test_the_users_file_gives_roles_by_password_and_by_token(tmp_path: Path) -> None:
    path = tmp_path / "users.toml"
    add_entry(path, "user", "ana", "operator", hash_password("a long password"))
    token = new_token()
    add_entry(path, "token", "grafana", "viewer", token_digest(token))
    add_entry(path, "user", "ana", "viewer", hash_password("another password"))  # replaced
    assert path.stat().st_mode & 0o777 == 0o600
    assert token not in path.read_text()  # only its digest is kept
    users = Users.read(path)
    assert users.login("ana", "a long password") is None
    assert users.login("ana", "another password") == Who("ana", "viewer", "password")
    assert users.login("bo", "another password") is None
    assert users.bearer(token) == Who("grafana", "viewer", "token")
    assert users.bearer(token + "x") is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[[user]]\nname = "a"\nrole = "admin"\npassword = "scrypt$x"\n', "viewer or operator"),
        ('[[user]]\nname = "a"\nrole = "viewer"\npassword = "plain"\n', "scrypt$"),
        ('[[token]]\nname = "t"\nrole = "viewer"\nsha256 = "ab"\n', "64 hex"),
        ('[[user]]\nrole = "viewer"\n', "needs a name"),
        ("[[user\n", "users.toml"),
    ],
)
def test_a_bad_users_file_is_refused_with_what_is_wrong(
    tmp_path: Path, text: str, words: str
) -> None:
    path = tmp_path / "users.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        Users.read(path)
    assert words in str(info.value)


def test_a_missing_users_file_names_itself(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Users.read(tmp_path / "nowhere.toml")


def test_a_broker_without_a_users_file_makes_one_operator_token_once(tmp_path: Path) -> None:
    users_file, token_file = default_users(tmp_path)
    assert token_file is not None
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    assert Users.read(users_file).bearer(token) == Who("admin", "operator", "token")
    again, none = default_users(tmp_path)
    assert (again, none) == (users_file, None)
    assert Users.read(again).bearer(token) is not None  # the first token still works


def test_sessions_expire_and_a_changed_one_is_refused() -> None:
    sessions = Sessions(ttl_s=60.0)
    value = sessions.issue(Who("ana", "viewer", "password"), now=1000.0)
    assert sessions.check(value, 1030.0) == Who("ana", "viewer", "session")
    assert sessions.check(value, 1061.0) is None
    assert sessions.check(value.replace("|viewer|", "|operator|"), 1030.0) is None
    assert sessions.check("garbage", 1030.0) is None
    assert Sessions(60.0).check(value, 1030.0) is None  # another process's key


def _act(verb: str, target: str, holds: dict[str, Hold] | None = None) -> object:
    return act(
        Action(action=verb, target=target),  # type: ignore[arg-type]
        by="ana",
        now=10.0,
        holds=holds or {},
        workers=WORKERS,
        edges=EDGES,
    )


def test_holds_put_and_lift() -> None:
    drain = _act("drain", "north-a")
    assert drain.put == Hold("drain", "north-a", "ana", 10.0)  # type: ignore[attr-defined]
    held = {drain.put.field: drain.put}  # type: ignore[attr-defined]
    assert cordoned(held) == {"north-a"}
    cordon = _act("cordon", "north-a", held)  # a cordon replaces the drain
    assert cordon.put.kind == "cordon"  # type: ignore[attr-defined]
    lift = _act("uncordon", "north-a", held)
    assert lift.lift == "worker:north-a"  # type: ignore[attr-defined]
    assert lift.record["lifted"] == "drain"  # type: ignore[attr-defined]
    pause = _act("pause", "line-1-pc")
    lines = {pause.put.field: pause.put}  # type: ignore[attr-defined]
    assert set(paused(lines)) == {"line-1-pc"}
    assert cordoned(lines) == set()
    assert _act("resume", "line-1-pc", lines).lift == "line:line-1-pc"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("verb", "target", "status", "words"),
    [
        ("cordon", "ghost", 404, "no worker 'ghost'"),
        ("pause", "north-a", 404, "no line PC"),
        ("uncordon", "north-b", 409, "not drained or cordoned"),
        ("resume", "line-1-pc", 409, "not paused"),
    ],
)
def test_an_action_that_cannot_be_taken_says_why(
    verb: str, target: str, status: int, words: str
) -> None:
    with pytest.raises(ActionRefused) as info:
        _act(verb, target)
    assert info.value.status == status
    assert words in str(info.value)


def test_the_same_hold_twice_is_a_conflict() -> None:
    first = _act("pause", "line-1-pc").put  # type: ignore[attr-defined]
    with pytest.raises(ActionRefused, match="already paused"):
        _act("pause", "line-1-pc", {first.field: first})
    drain = _act("drain", "north-b").put  # type: ignore[attr-defined]
    with pytest.raises(ActionRefused, match="already drained"):
        _act("drain", "north-b", {drain.field: drain})


def _record(job_id: str, **kw: object) -> wire.TraceJob:
    base: dict[str, object] = {
        "received_at": 100.0,
        "job_id": job_id,
        "model": "defect-v1",
        "data_class": "wafer-image",
        "priority": 5,
        "bytes": 1000,
        "status": "ok",
        "latency_ms": 40.0,
        "queue_ms": 10.0,
        "service_ms": 20.0,
        "ran_on": "line-1-pc",
        "deadline_ms": 50.0,
    }
    return wire.TraceJob.model_validate(base | kw)


def test_a_lines_figures_split_local_offloaded_late_and_why() -> None:
    window = Window(60.0)
    records = [
        _record("a"),
        _record("b", latency_ms=80.0),  # late
        _record("c", offloaded=True, ran_on="north-a", worker="north-a"),
        _record("d", code="no_capacity"),
        _record("e", status="rejected", ran_on=None, code="queue_full"),
    ]
    window.add_trace(wire.EdgeTrace(node="line-1-pc", records=records), now=1000.0)
    line = window.lines(1000.0)["line-1-pc"]
    assert (line["jobs"], line["local"], line["offloaded"]) == (5, 3, 1)
    assert line["offloaded_to"] == {"north-a": 1}
    assert line["attainment"] == round(3 / 5, 4)
    other = line["latency_ms"]["other"]["p50"]  # 40 - 10 - 20, to its bin
    assert 10.0 <= other <= 10.5
    why = {r["code"]: r for r in line["stayed_local"]}
    assert why[None]["jobs"] == 2
    assert why["no_capacity"]["why"] == "every worker allowed to run it was full"
    assert [p["id"] for p in line["points"] if p["late"]] == ["b"]
    assert window.lines(1061.0) == {}  # out of the window


def test_a_pools_figures_come_from_its_completions() -> None:
    window = Window(10.0)
    for i, (ms, batch) in enumerate([(10.0, 1), (20.0, 4), (30.0, 4)]):
        done = Completion(
            job_id=f"j{i}",
            worker_id="north-a",
            status="ok",
            model="defect-v1",
            service_ms=ms,
            queue_ms=1.0,
            batch_size=batch,
            ts=0.0,
        )
        window.add_completion(done, now=5.0)
    pools = window.pools(5.0, lambda w: "north")
    model = pools["north"]["models"]["defect-v1"]
    assert pools["north"]["jobs"] == 3
    assert 20.0 <= model["service_ms"]["p50"] <= 21.0
    assert 30.0 <= model["service_ms"]["p99"] <= 31.5
    assert model["batch_size"]["p50"] == 4.0


def test_jobs_a_worker_refused_unrun_are_not_failures_and_take_no_service_time() -> None:
    # 1 answered, 5 refused as expired, 64 rejected: the worker failed none of them.
    window = Window(10.0)
    ends = [("ok", 20.0)] + [("expired", 0.0)] * 5 + [("rejected", 0.0)] * 64
    ends += [("expired", 0.0)] * 3  # ocr-v1: nothing ran at all
    for i, (status, ms) in enumerate(ends):
        done = Completion(
            job_id=f"j{i}",
            worker_id="north-a",
            status=status,  # type: ignore[arg-type]
            model="defect-v1" if i < 70 else "ocr-v1",
            service_ms=ms,
            queue_ms=3.0,
            batch_size=1,
            ts=0.0,
        )
        window.add_completion(done, now=5.0)
    models = window.pools(5.0, lambda w: "north")["north"]["models"]
    defect, ocr = models["defect-v1"], models["ocr-v1"]
    counts = {k: defect[k] for k in ("jobs", "ok", "expired", "rejected", "failed")}
    assert counts == {"jobs": 70, "ok": 1, "expired": 5, "rejected": 64, "failed": 0}
    assert 20.0 <= defect["service_ms"]["p50"] <= 21.0  # the one that ran, not 0.0
    assert defect["queue_ms"]["p50"] is not None  # every job waited
    assert ocr["service_ms"] == {"p50": None, "p99": None}  # the page shows a dash
    assert (ocr["expired"], ocr["failed"]) == (3, 0)


def test_a_campus_only_class_off_site_is_a_forbidden_cell() -> None:
    window = Window(60.0)
    records = [
        _record("a", ran_on="north-a", offloaded=True),
        _record("b", ran_on="cloud-1", offloaded=True),
        _record("c", ran_on="somewhere-unknown", offloaded=True),
    ]
    window.add_trace(wire.EdgeTrace(node="line-1-pc", records=records), now=1.0)
    zones = {"north-a": "campus/dc", "cloud-1": "offsite/cloud"}
    matrix = class_matrix(
        window.placements(),
        zones.get,
        lambda cls, origin, target: target.startswith("campus"),
        {"line-1-pc": "campus/line-1"},
    )
    cells = {(c["class"], c["zone"]): c for c in matrix["cells"]}
    assert cells[("wafer-image", "offsite/cloud")]["forbidden"] == 1
    assert cells[("wafer-image", "offsite/cloud")]["example"] == "b"
    assert cells[("wafer-image", "campus/dc")]["forbidden"] == 0
    assert cells[("wafer-image", "?")]["jobs"] == 1  # where it ran is not known here
    assert matrix["forbidden"] == 1


def test_a_sister_campus_s_worker_counts_under_that_campus_as_its_agreement_allows() -> None:
    ours = policy_of(site_doc("north-site", "south-site", send=PARTS_TERMS, receive={}))
    zones = {"north-cpu-1": "campus/fab-north/dc"}
    assert node_zone(zones, "north-cpu-1") == "campus/fab-north/dc"
    assert node_zone(zones, "north-cpu-1@south-site") == "peer:south-site"
    assert node_zone(zones, "elsewhere") is None
    sent = sorted(PARTS_TERMS["classes"])[0]
    origin = "campus/fab-north/line-1"
    assert may_run(ours, sent, origin, "peer:south-site")
    assert not may_run(ours, "wafer-image", origin, "peer:south-site")  # not in the agreement
    assert not may_run(ours, sent, origin, "peer:west-site")  # no agreement at all


def test_the_window_forgets_what_left_it_and_finds_recent_jobs() -> None:
    window = Window(10.0)
    window.add_trace(wire.EdgeTrace(node="line-1-pc", records=[_record("old")]), now=100.0)
    window.add_trace(wire.EdgeTrace(node="line-1-pc", records=[_record("new")]), now=105.0)
    assert window.lines(109.0)["line-1-pc"]["jobs"] == 2
    assert window.lines(110.5)["line-1-pc"]["jobs"] == 1  # the first second left
    found = window.find("new")
    assert found is not None
    assert found.edge == "line-1-pc"
    assert window.lines(200.0) == {}
    assert window.placements() == []


def test_percentiles_come_from_bins_five_percent_wide() -> None:
    assert percentile({}, 0.5) is None
    bins = Counter(bin_of(float(ms)) for ms in range(1, 101))
    p50, p99 = percentile(bins, 0.5), percentile(bins, 0.99)
    assert p50 is not None
    assert p99 is not None
    assert 50.0 <= p50 <= 50.0 * 1.05
    assert 99.0 <= p99 <= 99.0 * 1.05
    assert percentile({bin_of(0.0): 3}, 0.5) == 0.0
    assert words_for("something_new") == "code something_new"
    assert "expected to meet the deadline" in words_for(None)


def test_the_consoles_shadow_section_is_shadows_document_less_recent_and_small_moves() -> None:
    shadow = Shadow(policy=None, params=PlacementParams(), fleet_params=FleetParams(), label="cand")
    tally = shadow.tally
    tally.outcomes.update(same=30, moved=MOVES_SHOWN + 3, candidate_refused=3)
    for i in range(MOVES_SHOWN + 2):  # a pair per worker, the last one moved most
        tally.moved[(f"w-{i:02}", "cloud-1")] = 1 + (i == MOVES_SHOWN + 1)
    tally.refusals["no_worker"] = 3
    tally.forbidden[("wafer-image", "offsite/cloud-east")] = 2
    compared = Compared("j-1", "m", "wafer-image", "moved", "w-00", "cloud-1", 5.0, 3.0, True)
    tally.recent.append(compared)
    served = shadow_facts(shadow)
    shown = shadow_section(shadow)
    assert served["recent_differences"] == [compared.as_dict()]
    assert "recent_differences" not in shown
    same = ("candidate", "decisions", "agreement", "outcomes", "candidate_refusals", "forbidden")
    assert {k: shown[k] for k in same} == {k: served[k] for k in same}
    assert (shown["candidate"], shown["decisions"], shown["agreement"]) == ("cand", 46, 0.6522)
    assert shown["moved_pairs"] == len(served["moved"]) == MOVES_SHOWN + 2
    assert len(shown["moved"]) == MOVES_SHOWN
    assert shown["moved"][0] == {
        "production": f"w-{MOVES_SHOWN + 1:02}",
        "candidate": "cloud-1",
        "jobs": 2,
    }
    assert [m["production"] for m in shown["moved"][1:]] == [
        f"w-{i:02}" for i in range(MOVES_SHOWN - 1)
    ]
