"""Training a placement policy in the twin: the policy rides the production decision, the
cross-entropy method finds one no worse than the heuristic on its scenarios, and the
command writes it as an artifact the broker's loader accepts."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from broker.core.learned import FEATURES, HEURISTIC, LearnedPolicy, load
from sluicegate.app.cli import app
from sluicegate.app.twin_demo import demo_trace
from sluicegate.twin.nodes import Change
from sluicegate.twin.sim import replay
from sluicegate.twin.trace import read, write
from sluicegate.twin.train import (
    Scenario,
    Score,
    Weights,
    off_site_of,
    perturbations,
    reward,
    run,
    score,
    train,
)

TRACE = demo_trace(6.0, bursts=((1.0, 3.0),), seed=7)


def test_a_learned_policy_changes_where_the_twin_places_and_never_breaks_the_policy() -> None:
    away = LearnedPolicy(tuple(-50.0 if f == "off_site" else 0.0 for f in FEATURES))
    off = off_site_of(TRACE)
    assert off == {"cloud-cpu-1"}
    heuristic = score(replay(TRACE, Change(burst=3)), off)
    keen = score(replay(TRACE, Change(burst=3, learned=away)), off)
    assert keen.off_site > heuristic.off_site
    assert keen.forbidden == heuristic.forbidden == 0
    # The heuristic written as a policy is the heuristic.
    same = replay(TRACE, Change(burst=3, learned=HEURISTIC))
    assert [o.where for o in same.outcomes] == [
        o.where for o in replay(TRACE, Change(burst=3)).outcomes
    ]


def test_the_cross_entropy_method_returns_a_policy_no_worse_than_the_heuristic() -> None:
    scenarios = [Scenario("3x", TRACE, Change(burst=3)), Scenario("5x", TRACE, Change(burst=5))]
    policy, reward = train(scenarios, rounds=2, population=4, elite=2, seed=3)
    assert reward >= 0.0
    assert policy.trained["method"] == "cross-entropy"
    assert policy.trained["scenarios"] == ["3x", "5x"]
    assert all(score(run(s, policy), off_site_of(TRACE)).forbidden == 0 for s in scenarios)


def test_the_perturbations_cover_bursts_a_slow_and_a_lost_worker_and_a_slow_link() -> None:
    names = [s.name for s in perturbations(TRACE, "t")]
    assert names == [
        "t 2x",
        "t 4x",
        "t 6x",
        "t 2x, north-cpu-1 4x slower",
        "t 2x, cloud-cpu-1 lost",
        "t 2x, 80 ms off site",
    ]


def test_twin_train_writes_a_policy_the_loader_accepts(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl.gz"
    write(trace, demo_trace(3.0, bursts=((0.5, 1.0),), seed=8))
    out = tmp_path / "placement.json"
    cmd = ["twin", "train", "--trace", str(trace), "--out", str(out), "--rounds", "1"]
    got = CliRunner().invoke(app, [*cmd, "--population", "2", "--seeds", "2", "--worst", "1"])
    assert got.exit_code == 0, got.output
    assert "sha256" in got.output
    assert "over 12 scenarios" in got.output  # six perturbations, each with seeds 0 and 1
    trained = load(out).trained
    assert trained["scenarios"][:2] == ["t.jsonl.gz 2x", "t.jsonl.gz 2x seed 1"]
    assert trained["worst"] == 1.0
    bad = CliRunner().invoke(app, [*cmd, "--population", "1"])
    assert bad.exit_code == 2
    assert "--population at least 2" in bad.output


def test_the_worst_trace_term_makes_a_loss_on_one_trace_cost_beyond_the_mean() -> None:
    heuristic = [Score(0.90, 10.0, 0.0, 0)] * 3
    mine = [Score(0.93, 10.0, 0.0, 0), Score(0.93, 10.0, 0.0, 0), Score(0.87, 10.0, 0.0, 0)]
    groups = ["recorded", "recorded", "synthetic"]
    mean_only = reward(mine, heuristic, Weights(), groups)
    assert round(mean_only, 6) == 0.01  # (3 + 3 - 3) points over three scenarios
    assert round(reward(mine, heuristic, Weights(worst=1.0), groups), 6) == -0.02
    # a policy that loses nowhere pays nothing for it
    better = [Score(0.91, 10.0, 0.0, 0)] * 3
    assert round(reward(better, heuristic, Weights(worst=1.0), groups), 6) == 0.01


def test_twin_synth_writes_the_training_traces_by_seed_and_burst_length(tmp_path: Path) -> None:
    def synth(name: str, *extra: str) -> list[tuple[float, str]]:
        out = tmp_path / name
        cmd = ["twin", "synth", "--out", str(out), "--seconds", "30", "--burst-every", "15"]
        got = CliRunner().invoke(app, [*cmd, *extra])
        assert got.exit_code == 0, got.output
        return [(j.at, j.data_class) for j in read(out)[0].jobs]

    one = synth("a.jsonl.gz", "--burst-for", "6", "--seed", "1")
    assert synth("b.jsonl.gz", "--burst-for", "6", "--seed", "1") == one
    assert synth("c.jsonl.gz", "--burst-for", "6", "--seed", "2") != one
    # a burst sends volleys from line 1: 6 s long, from 5 s and from 20 s
    volleys = {round(at) for at, _ in one if sum(a == at for a, _ in one) > 2}
    assert min(volleys) == 5
    assert max(volleys) <= 26
    bad = CliRunner().invoke(app, ["twin", "synth", "--out", "x", "--burst-for", "0"])
    assert bad.exit_code == 2
