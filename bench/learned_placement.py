"""Benchmark: a learned placement policy against the heuristic and the simple strategies,
on held-out traces the policy never trained on.

The policy (``--policy FILE``, with its ``.sha256`` beside it; without one, a policy is
trained first, as ``sluicegate twin train`` does, on demo traces of other seeds and burst
times, and on ``--train-trace`` recordings, ``--seeds`` times each, with ``--worst``
weighing the worst trace's loss, the two demo traces counting as one; ``--save`` keeps it)
is replayed in the twin on each held-out scenario: a demo-campus trace of ``--seconds``
(``sluicegate.app.twin_demo``, seeds the training never used) with each perturbation of
``sluicegate.twin.train.perturbations`` (bursts of 2x to 6x, the campus worker four times
slower, the off-site worker lost half-way, an 80 ms link off site), and ``--trace`` files
(recorded campuses) the same way. Beside it, on the same scenarios: the
heuristic (today's ``placement.decide``), least-loaded, round-robin, edge-only, and the
hindsight oracle (``sluicegate.twin.oracle``: each second placed by whichever of those
rules, the learned one included, the real future favours) as the bound. Per arm and per
set (synthetic, recorded): deadline attainment, pool device-seconds (the workers' slots'
compute time), the share run off site; the share of the heuristic-to-oracle gap the
learned policy closes; placements the policy in force forbids (0 for every arm, or the run
fails) and scenarios where an arm beat the oracle (where it is no bound).

    .venv/bin/python bench/learned_placement.py --policy policies/placement/placement-v5.json \
        --trace bench/traces/recorded-4.jsonl.gz
    .venv/bin/python bench/learned_placement.py --seconds 3 --train-rounds 1 --population 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import stats
from broker.core.learned import LearnedPolicy, load, save
from sluicegate.app.twin_demo import demo_trace
from sluicegate.twin.nodes import STRATEGIES
from sluicegate.twin.oracle import hindsight, rules_of
from sluicegate.twin.trace import Trace, read
from sluicegate.twin.train import (
    Scenario,
    Score,
    Weights,
    off_site_of,
    perturbations,
    run,
    score,
    train,
)

ARMS = ("learned", "heuristic", "least-loaded", "round-robin", "edge-only", "oracle")
HELD_OUT_SEEDS = (101, 202)  # the training below uses 1 and 2


def _demo(seconds: float, seed: int) -> Trace:
    third = seconds / 3.0
    return demo_trace(
        seconds, bursts=((third * 0.5, third * 0.6), (third * 2.0, third * 0.6)), seed=seed
    )


def _policy(args: argparse.Namespace) -> LearnedPolicy:
    if args.policy is not None:
        return load(args.policy)
    synthetic = [(_demo(args.seconds, seed), f"train-{seed}", "synthetic") for seed in (1, 2)]
    traces = [(read(p)[0], p.name, p.name) for p in args.train_trace] + synthetic
    scenarios = [
        replace(s, name=f"{s.name} seed {k}", seed=k, group=group) if args.seeds > 1 else s
        for k in range(args.seeds)
        for trace, name, group in traces
        for s in perturbations(trace, name)
    ]
    policy, reward = train(
        scenarios,
        rounds=args.train_rounds,
        population=args.population,
        elite=max(2, args.population // 4) if args.seeds > 1 else 3,
        seed=0,
        weights=Weights(worst=args.worst),
        version=args.version,
    )
    print(f"trained here: {len(scenarios)} scenarios, reward {reward:+.4f} against the heuristic")
    if args.save is not None:
        print(f"saved {args.save}, sha256 {save(policy, args.save)}")
    return policy


def _arm(s: Scenario, arm: str, policy: LearnedPolicy, step_s: float) -> Score:
    off = off_site_of(s.trace)
    if arm == "oracle":
        return score(hindsight(s.trace, s.change, rules_of(policy), step_s=step_s).result, off)
    if arm == "learned":
        return score(run(s, policy), off)
    strategy = next(x for x in STRATEGIES if x == ("ours" if arm == "heuristic" else arm))
    return score(run(s, None, strategy), off)


@dataclass(frozen=True)
class Group:
    """The arms' figures over one set of held-out scenarios (synthetic, or recorded)."""

    name: str
    attainment: dict[str, float]  # mean over the scenarios
    device_s: dict[str, float]  # summed
    off_site: dict[str, float]  # mean share

    @property
    def gain(self) -> float:
        """The learned policy's attainment over the heuristic's, in points."""
        return (self.attainment["learned"] - self.attainment["heuristic"]) * 100

    @property
    def saved(self) -> float:
        """The share of the heuristic's pool device-seconds the learned policy does without."""
        base = self.device_s["heuristic"]
        return 1.0 - self.device_s["learned"] / base if base else 0.0

    @property
    def closed(self) -> float | None:
        """The share of the heuristic-to-oracle gap the learned policy closes (None: no gap)."""
        gap = self.attainment["oracle"] - self.attainment["heuristic"]
        return self.gain / 100 / gap if gap > 5e-4 else None

    @property
    def holds(self) -> bool:
        """Beats the heuristic, or matches it within 0.2 points with 15 % fewer device-s."""
        return self.gain > 0 or (self.gain >= -0.2 and self.saved >= 0.15)


def _group(name: str, figures: dict[str, list[Score]]) -> Group:
    n = max(len(figures["heuristic"]), 1)
    return Group(
        name,
        {a: sum(f.attainment for f in v) / n for a, v in figures.items()},
        {a: sum(f.device_s for f in v) for a, v in figures.items()},
        {a: sum(f.off_site for f in v) / n for a, v in figures.items()},
    )


def _print_group(g: Group) -> None:
    print(f"  {g.name}:")
    for a in ARMS:
        print(
            f"    {a:13} attainment {g.attainment[a]:.4f}  pool device-s {g.device_s[a]:8.1f}  "
            f"off site {g.off_site[a]:.3f}"
        )
    closed = "no gap" if g.closed is None else f"{g.closed * 100:.0f} %"
    print(
        f"    learned - heuristic: attainment {g.gain:+.2f} points, pool device-seconds "
        f"{-g.saved * 100:+.1f} %; of the heuristic-to-oracle gap it closes {closed}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policy", type=Path, help="the policy file (default: train one here)")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each demo trace")
    ap.add_argument("--trace", type=Path, action="append", default=[], help="a recorded trace")
    ap.add_argument("--train-rounds", type=int, default=5)
    ap.add_argument("--population", type=int, default=10)
    ap.add_argument(
        "--train-trace",
        type=Path,
        action="append",
        default=[],
        help="a recorded trace to train on as well (each its own group for --worst)",
    )
    ap.add_argument("--seeds", type=int, default=1, help="replay each training scenario so often")
    ap.add_argument("--worst", type=float, default=0.0, help="the reward's worst-trace weight")
    ap.add_argument("--version", default="1", help="the version the trained policy names")
    ap.add_argument("--save", type=Path, help="write the policy trained here (and its sha256)")
    ap.add_argument("--oracle-step", type=float, default=1.0, help="the oracle's step, s")
    args = ap.parse_args()
    t0 = time.perf_counter()
    policy = _policy(args)
    sets: dict[str, list[Scenario]] = {"synthetic": [], "recorded": []}
    for seed in HELD_OUT_SEEDS:
        sets["synthetic"] += perturbations(_demo(args.seconds, seed), f"demo seed {seed}")
    for path in args.trace:
        sets["recorded"] += perturbations(read(path)[0], path.name)
    groups: list[Group] = []
    forbidden = beaten = 0
    print(f"{'scenario':40}" + "".join(f"{a:>14}" for a in ARMS))
    for name, held in sets.items():
        if not held:
            continue
        figures: dict[str, list[Score]] = {a: [] for a in ARMS}
        for s in held:
            row = {a: _arm(s, a, policy, args.oracle_step) for a in ARMS}
            for a, f in row.items():
                figures[a].append(f)
            forbidden += sum(f.forbidden for f in row.values())
            beaten += any(f.attainment > row["oracle"].attainment for f in row.values())
            cells = "".join(f"{row[a].attainment:8.3f}{row[a].device_s:6.0f}" for a in ARMS)
            print(f"{s.name[:40]:40}{cells}", flush=True)
        groups.append(_group(name, figures))
    scenarios = sum(len(v) for v in sets.values())
    print(f"{'(attainment, pool device-s)':40}")
    print(
        f"learned placement: policy {policy.version} ({policy.trained.get('method', 'given')}), "
        f"{scenarios} held-out scenarios, nproc {os.cpu_count()}, {time.perf_counter() - t0:.0f} s"
    )
    for g in groups:
        _print_group(g)
    print(
        f"  forbidden placements, every arm: {forbidden}; scenarios where an arm beat the "
        f"oracle: {beaten}"
    )
    result = {
        "bench": "learned_placement",
        "subject": {g.name: {"attainment": g.attainment["learned"]} for g in groups},
        "baseline": {g.name: g.attainment for g in groups},
        "device_s": {g.name: g.device_s for g in groups},
        "ratio": {
            g.name: {"attainment_points": g.gain, "device_s_saved": g.saved, "gap_closed": g.closed}
            for g in groups
        },
        "target": {"attainment_points": -0.2, "device_s_saved": 0.15, "gap_closed": 0.5},
        "met": all(g.holds for g in groups)
        and any(g.closed is not None and g.closed >= 0.5 for g in groups),
        "measured": stats.require(
            {"held-out scenarios": scenarios, "arms replayed": scenarios * len(ARMS)}
        ),
        "forbidden": forbidden,
        "oracle_beaten": beaten,
        "machine": stats.machine(),
    }
    print(stats.result_line(result))
    if forbidden:
        sys.exit(f"{forbidden} forbidden placements")


if __name__ == "__main__":
    main()
