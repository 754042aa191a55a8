"""Benchmark: a learned placement policy against the heuristic and the simple strategies,
on held-out traces the policy never trained on.

The policy (``--policy FILE``, with its ``.sha256`` beside it; without one, a policy is
trained first, as ``sluicegate twin train`` does, on demo traces of other seeds and burst
times) is replayed in the twin on each held-out scenario: a demo-campus trace of
``--seconds`` (``sluicegate.app.twin_demo``, seeds the training never used) with each
perturbation of ``sluicegate.twin.train.perturbations`` (bursts of 2x to 6x, the campus
worker four times slower, the off-site worker lost half-way, an 80 ms link off site), and
``--trace`` files (recorded campuses) the same way. Beside it, on the same scenarios: the
heuristic (today's ``placement.decide``), least-loaded, round-robin and edge-only. Per arm:
deadline attainment, pool device-seconds (the workers' slots' compute time), the share run
off site, and placements the policy in force forbids (0 for every arm, or the run fails).

    .venv/bin/python bench/learned_placement.py --policy models/placement-policy.json
    .venv/bin/python bench/learned_placement.py --seconds 3 --train-rounds 1 --population 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import stats
from broker.core.learned import LearnedPolicy, load
from sluicegate.app.twin_demo import demo_trace
from sluicegate.twin.nodes import STRATEGIES
from sluicegate.twin.trace import Trace, read
from sluicegate.twin.train import Scenario, Score, off_site_of, perturbations, run, score, train

ARMS = ("learned", "heuristic", "least-loaded", "round-robin", "edge-only")
HELD_OUT_SEEDS = (101, 202)  # the training below uses 1 and 2


def _demo(seconds: float, seed: int) -> Trace:
    third = seconds / 3.0
    return demo_trace(
        seconds, bursts=((third * 0.5, third * 0.6), (third * 2.0, third * 0.6)), seed=seed
    )


def _policy(args: argparse.Namespace) -> LearnedPolicy:
    if args.policy is not None:
        return load(args.policy)
    scenarios = [
        s for seed in (1, 2) for s in perturbations(_demo(args.seconds, seed), f"train-{seed}")
    ]
    policy, reward = train(scenarios, rounds=args.train_rounds, population=args.population, seed=0)
    print(f"trained here: {len(scenarios)} scenarios, reward {reward:+.4f} against the heuristic")
    return policy


def _arm(s: Scenario, arm: str, policy: LearnedPolicy) -> Score:
    off = off_site_of(s.trace)
    if arm == "learned":
        return score(run(s, policy), off)
    strategy = next(x for x in STRATEGIES if x == ("ours" if arm == "heuristic" else arm))
    return score(run(s, None, strategy), off)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policy", type=Path, help="the policy file (default: train one here)")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each demo trace")
    ap.add_argument("--trace", type=Path, action="append", default=[], help="a recorded trace")
    ap.add_argument("--train-rounds", type=int, default=5)
    ap.add_argument("--population", type=int, default=10)
    args = ap.parse_args()
    t0 = time.perf_counter()
    policy = _policy(args)
    held: list[Scenario] = []
    for seed in HELD_OUT_SEEDS:
        held += perturbations(_demo(args.seconds, seed), f"demo seed {seed}")
    for path in args.trace:
        held += perturbations(read(path)[0], path.name)
    figures: dict[str, list[Score]] = {arm: [_arm(s, arm, policy) for s in held] for arm in ARMS}
    print(
        f"learned placement: policy {policy.version} ({policy.trained.get('method', 'given')}), "
        f"{len(held)} held-out scenarios, nproc {os.cpu_count()}, {time.perf_counter() - t0:.0f} s"
    )
    print(f"{'scenario':40}" + "".join(f"{a:>14}" for a in ARMS))
    for i, s in enumerate(held):
        row = "".join(f"{figures[a][i].attainment:8.3f}{figures[a][i].device_s:6.0f}" for a in ARMS)
        print(f"{s.name[:40]:40}{row}")
    print(f"{'(attainment, pool device-s)':40}")
    mean = {a: sum(f.attainment for f in figures[a]) / len(held) for a in ARMS}
    device = {a: sum(f.device_s for f in figures[a]) for a in ARMS}
    off = {a: sum(f.off_site for f in figures[a]) / len(held) for a in ARMS}
    forbidden = sum(f.forbidden for a in ARMS for f in figures[a])
    for a in ARMS:
        print(
            f"  {a:13} attainment {mean[a]:.4f}  pool device-s {device[a]:8.1f}  "
            f"off site {off[a]:.3f}"
        )
    gain = (mean["learned"] - mean["heuristic"]) * 100
    saved = 1.0 - device["learned"] / device["heuristic"] if device["heuristic"] else 0.0
    print(
        f"  learned - heuristic: attainment {gain:+.2f} points, pool device-seconds "
        f"{-saved * 100:+.1f} %; forbidden placements, every arm: {forbidden}"
    )
    result = {
        "bench": "learned_placement",
        "subject": {"attainment": mean["learned"], "device_s": device["learned"]},
        "baseline": {a: {"attainment": mean[a], "device_s": device[a]} for a in ARMS[1:]},
        "ratio": {"attainment_points": gain, "device_s_saved": saved},
        "target": {"attainment_points": -0.2, "device_s_saved": 0.15},
        "met": gain > 0 or (gain >= -0.2 and saved >= 0.15),
        "measured": stats.require(
            {
                "held-out scenarios": len(held),
                "arms replayed": sum(len(v) for v in figures.values()),
            }
        ),
        "forbidden": forbidden,
        "machine": stats.machine(),
    }
    print(stats.result_line(result))
    if forbidden:
        sys.exit(f"{forbidden} forbidden placements")


if __name__ == "__main__":
    main()
