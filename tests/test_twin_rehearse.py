"""Rehearsing a change: the engineer's files read (each mistake refused with a message
that names it), baseline and candidate compared, the report and plots written the same
way for the same inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policies.keys import SigningKey
from policies.loader import parse_policy
from policies.verdict import judge, read_verdict
from sluicegate.app.twin_demo import demo_policy, demo_trace
from sluicegate.twin import judge as tw_judge
from sluicegate.twin import trace
from sluicegate.twin.nodes import Change
from sluicegate.twin.rehearse import (
    ChangeError,
    Rehearsal,
    build_change,
    rehearse,
    write_report,
)
from tests.support import twin

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("twin") / "demo.jsonl.gz"
    trace.write(path, demo_trace(10.0, bursts=((2.0, 4.0),)))
    return path


def _change(**kw: object) -> Change:
    args: dict[str, object] = {
        "policy": None,
        "params": None,
        "fleet": None,
        "burst": 1,
        "fail": [],
        "strategy": "ours",
    }
    args.update(kw)
    return build_change(**args)  # type: ignore[arg-type]


def test_a_fleet_change_and_a_failure_are_rehearsed_side_by_side(
    trace_file: Path, tmp_path: Path
) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('remove = ["cloud-cpu-1"]\n[degrade]\nnorth-cpu-1 = 3.0\n')
    change = build_change(
        policy=None, params=None, fleet=fleet, burst=2, fail=["north-cpu-1@6"], strategy="ours"
    )
    assert change.remove == ("cloud-cpu-1",)
    assert change.degrade == (("north-cpu-1", 3.0),)
    assert change.fail == (("north-cpu-1", 6.0),)
    r = rehearse(trace_file, change, strategies=True)
    assert r.comparison.candidate.jobs == 2 * r.comparison.baseline.jobs
    assert r.comparison.candidate.attainment < r.comparison.baseline.attainment
    assert "deadline attainment" in r.text
    assert "placement strategies" in r.text
    # What moved, the largest first, in the verdict's words.
    assert r.comparison.moves
    assert r.comparison.moves == sorted(r.comparison.moves, key=lambda m: -m[4])
    first = r.text.split("largest moves:\n", 1)[1].splitlines()[0]
    assert first.startswith(f"  {r.comparison.moves[0][4]} ")
    assert "cloud-cpu-1" not in r.comparison.candidate.utilisation


def test_the_report_and_plots_are_the_same_for_the_same_inputs(
    trace_file: Path, tmp_path: Path
) -> None:
    change = build_change(
        policy=None, params=None, fleet=None, burst=2, fail=[], strategy="round-robin"
    )
    first = write_report(rehearse(trace_file, change, seed=1), tmp_path / "a")
    second = write_report(rehearse(trace_file, change, seed=1), tmp_path / "b")
    assert [p.name for p in first] == ["report.json", "attainment.png", "queue-depth.png"]
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes()
    assert first[1].read_bytes().startswith(PNG)
    report = json.loads(first[0].read_text())
    assert report["trace_sha256"] == trace.read(trace_file)[1]
    assert report["candidate"]["jobs"] == 2 * report["baseline"]["jobs"]


def test_placement_parameters_from_a_file_change_the_decisions(
    trace_file: Path, tmp_path: Path
) -> None:
    params = tmp_path / "params.toml"
    params.write_text("link_latency_ms = [0.2, 0.5, 400.0]\n")
    change = build_change(policy=None, params=params, fleet=None, burst=2, fail=[], strategy="ours")
    assert change.params is not None
    assert change.params.link_latency_ms == (0.2, 0.5, 400.0)
    r = rehearse(trace_file, change)
    # An off-site link too slow for a 200 ms deadline: no part image goes there.
    assert r.comparison.candidate.zones["part-image"].get("offsite/cloud-east", 0) == 0
    assert r.comparison.baseline.zones["part-image"].get("offsite/cloud-east", 0) > 0


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("params", "top_k = 0\n", "top_k"),
        ("params", "no_such = 1\n", "unknown no_such"),
        ("params", "top_k = [\n", "not valid TOML"),
        ("fleet", 'remove = "x"\nextra = 1\n', "unknown extra"),
        ("fleet", "[degrade]\nnorth-cpu-1 = -1\n", "factors are numbers > 0"),
        ("fleet", '[[add]]\nid = "w"\n', "a worker to add"),
        ("policy", "format = 3\n", "candidate policy"),
    ],
)
def test_a_change_file_that_cannot_be_used_is_named(
    tmp_path: Path, name: str, text: str, match: str
) -> None:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    with pytest.raises(ChangeError, match=match):
        _change(**{name: path})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"fail": ["north-cpu-1"]}, "worker@seconds"),
        ({"burst": 0}, "--burst 0"),
        ({"strategy": "random"}, "one of ours"),
        ({"params": Path("/nonexistent/params.toml")}, "cannot be read"),
    ],
)
def test_a_flag_that_cannot_be_used_is_named(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ChangeError, match=match):
        _change(**kw)


def test_a_failure_of_a_worker_the_trace_lacks_is_refused(trace_file: Path) -> None:
    change = build_change(
        policy=None, params=None, fleet=None, burst=1, fail=["north-gpu-9@3"], strategy="ours"
    )
    with pytest.raises(ChangeError, match="no worker north-gpu-9"):
        rehearse(trace_file, change)


# -- the commands, as an engineer runs them ------------------------------------------------


def test_synth_run_and_verdict_from_the_command_line(tmp_path: Path) -> None:
    made = twin(
        "synth", "--out", "demo.jsonl.gz", "--seconds", "20", "--burst-every", "10", cwd=tmp_path
    )
    assert made.returncode == 0, made.stderr
    assert "jobs over 20 s" in made.stdout
    ran = twin(
        "run", "--trace", "demo.jsonl.gz", "--burst", "2", "--fail", "north-cpu-1@5",
        "--out", "rep", cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert "deadline attainment" in ran.stdout
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == [
        "attainment.png",
        "queue-depth.png",
        "report.json",
    ]
    key = SigningKey.from_seed(b"w" * 32)
    (tmp_path / "twin.key").write_bytes(key.to_pem())
    # A synthetic trace holds its policy as a recorded one does: its canonical JSON. The
    # candidates start from the campus's policy file (its sealing keys made afresh: the
    # twin models none).
    header = trace.read(tmp_path / "demo.jsonl.gz")[0].header
    recorded = trace.policy_of(header)
    assert header.policy == recorded.canonical.decode()
    text = demo_policy()
    assert parse_policy(text).version == recorded.version
    (tmp_path / "leaky.toml").write_text(
        text.replace(WAFER_RULE, 'allow = ["campus/**", "campus/** -> offsite/cloud-east"]')
    )
    (tmp_path / "same.toml").write_text(text)
    sign = ("--key", "twin.key", "--key-id", "twin-1", "--trace", "demo.jsonl.gz", "--burst", "2")
    failed = twin(
        "verdict", *sign, "--policy", "leaky.toml", "--out", "leaky.verdict", cwd=tmp_path
    )
    assert failed.returncode == 1, failed.stderr
    assert "wafer-image jobs would run in offsite/cloud-east" in failed.stdout
    verdict = read_verdict((tmp_path / "leaky.verdict").read_bytes())
    assert not verdict.body.passed
    assert verdict.body.conditions == {"burst": "2x the recorded arrivals"}
    assert verdict.body.burst == 2.0
    passed = twin("verdict", *sign, "--policy", "same.toml", "--out", "same.verdict", cwd=tmp_path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert read_verdict((tmp_path / "same.verdict").read_bytes()).body.passed
    both = twin("verdict", *sign, "--out", "x.verdict", cwd=tmp_path)
    assert both.returncode == 2
    assert "--policy FILE or --params FILE" in both.stderr
    bad = twin("run", "--trace", "missing.jsonl.gz", cwd=tmp_path)
    assert bad.returncode == 2
    assert "no such trace file" in bad.stderr


WAFER_RULE = 'allow = ["campus/**"]\ndeny = ["offsite/**"]'


# -- a verdict judges the change, not the campus ------------------------------------------


def judged(r: Rehearsal) -> tuple[bool, list[str]]:
    """The verdict's judgement of a rehearsal, as ``twin verdict`` makes it."""
    figures = tw_judge.figures_of(r.judged.candidate, r.trace, r.judged.baseline, r.judged.moves)
    return judge(figures, tw_judge.thresholds_of(trace.policy_of(r.trace.header)))


def test_on_a_loaded_trace_no_change_passes_and_a_harmful_one_names_what_it_moved(
    trace_file: Path, tmp_path: Path
) -> None:
    # Five times the arrivals with both workers ten times slower: the policy in force
    # itself misses the default 0.95 there. The recorded parameters pass (the change is
    # judged, not the campus); a starved campus link fails, naming the worker its jobs left.
    # (Starved, not cut: a link so slow that no placement is due in time leaves the line PCs
    # rescuing every job, and the harm shows as the worker's peak instead.)
    fleet = tmp_path / "slow.toml"
    fleet.write_text("[degrade]\nnorth-cpu-1 = 10.0\ncloud-cpu-1 = 10.0\n")
    same = tmp_path / "same.toml"
    same.write_text("")
    starved = tmp_path / "starved.toml"
    starved.write_text(
        "link_latency_ms = [0.2, 60.0, 0.0]\nlink_mb_per_s = [1000.0, 1.0, 100000.0]\n"
    )
    harmless = rehearse(trace_file, _change(params=same, fleet=fleet, burst=5))
    assert harmless.judged.baseline.attainment < 0.95  # the campus misses the floor ...
    assert judged(harmless) == (True, [])  # ... and the change that changes nothing passes
    harmful = rehearse(trace_file, _change(params=starved, fleet=fleet, burst=5))
    assert harmful.judged.baseline == harmless.judged.baseline  # the same policy in force
    passed, reasons = judged(harmful)
    assert not passed
    assert any("line line-1-pc: deadline attainment falls" in r for r in reasons), reasons
    assert any("(they ran on north-cpu-1)" in r for r in reasons), reasons
