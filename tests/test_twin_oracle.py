"""The twin's hindsight oracle (``sluicegate.twin.oracle``): a replay copied mid-run goes on
exactly as the original, and the oracle, trying each rule on such copies of the real
future, does at least as well as every rule it chooses from, switching between them, with
no placement the policy forbids."""

from __future__ import annotations

import copy
from pathlib import Path

from broker.core.learned import load
from sluicegate.app.twin_demo import demo_trace
from sluicegate.twin.nodes import Change
from sluicegate.twin.oracle import hindsight, rules_of
from sluicegate.twin.sim import Simulation, digest_of, replay
from sluicegate.twin.train import Scenario, off_site_of, run, score

SHIPPED = Path(__file__).resolve().parents[1] / "policies" / "placement" / "placement-v5.json"
TRACE = demo_trace(8.0, bursts=((2.0, 4.0),), seed=5)
# A burst while the campus worker runs four times slower: the heuristic misses deadlines.
SLOW = Scenario("slow", TRACE, Change(burst=2, degrade=(("north-cpu-1", 4.0),)))


def test_a_replay_copied_mid_run_goes_on_exactly_as_the_original() -> None:
    whole = replay(TRACE, SLOW.change)
    sim = Simulation(TRACE, SLOW.change)
    sim.start()
    sim.advance(sim.t0 + 4.0)
    fork = copy.deepcopy(sim, {id(sim.arrivals): sim.arrivals})
    sim.advance(float("inf"))
    assert len(fork.events.outcomes) < len(sim.events.outcomes)  # the copy holds its own
    fork.advance(float("inf"))
    assert digest_of(fork.result()) == digest_of(sim.result()) == digest_of(whole)


def test_the_oracle_does_at_least_as_well_as_every_rule_it_chooses_from() -> None:
    policy = load(SHIPPED)
    off = off_site_of(TRACE)
    alone = {
        "heuristic": score(run(SLOW, None), off),
        "learned": score(run(SLOW, policy), off),
        **{s: score(run(SLOW, None, s), off) for s in ("least-loaded", "round-robin")},
        "edge-only": score(run(SLOW, None, "edge-only"), off),
    }
    oracle = hindsight(TRACE, SLOW.change, rules_of(policy), seed=SLOW.seed)
    mine = score(oracle.result, off)
    assert all(mine.attainment >= a.attainment for a in alone.values()), (mine, alone)
    assert mine.attainment > alone["heuristic"].attainment
    assert len(oracle.chosen) > 1  # it switched rule as the future favoured
    assert sum(oracle.chosen.values()) >= 8  # a choice for each second of arrivals
    assert oracle.result.violations == 0
    assert len(oracle.result.outcomes) == 2 * len(TRACE.jobs)  # every job concluded


def test_without_a_learned_policy_the_oracle_chooses_among_the_simple_rules() -> None:
    oracle = hindsight(TRACE, SLOW.change, rules_of(None), seed=SLOW.seed)
    assert set(oracle.chosen) <= {"heuristic", "least-loaded", "round-robin", "edge-only"}
    off = off_site_of(TRACE)
    assert score(oracle.result, off).attainment >= score(run(SLOW, None), off).attainment
