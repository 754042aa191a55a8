"""Training a placement policy in the digital twin (``broker.core.learned``).

The method is the cross-entropy method: a Gaussian over the policy's parameters (its
feature weights and its keep share), from which each round draws a population; each member
is replayed on every training scenario (a trace and a change: a burst, a slow or lost
worker, a slow link), the best few by reward become the next round's mean and spread. It
suits this problem: a dozen parameters, a reward that only a whole replay measures (no
gradient through a discrete-event simulation), replays that are cheap and deterministic,
and a policy small enough to read. The reward of a member over the scenarios, each against
the heuristic replayed on the same scenario:

    reward = mean(attainment - heuristic's) - cost * mean(device-s / heuristic's - 1)
             - off_site * mean(off-site share - heuristic's)

so it gains by meeting more deadlines, and, at equal attainment, by using fewer pool
device-seconds and less of the off-site pool; with a ``worst`` weight, the trace (of those
trained on) where it loses most to the heuristic, on average over that trace's scenarios,
costs it that loss times ``worst`` besides, so a gain on one kind of trace cannot buy a
loss on another. Hard limits are not the policy's to learn:
every candidate it sees has passed the rules (``placement.decide``), and a replay counts the
placements the policy in force forbids (always 0). Pure but for the replays' time; seeded,
so a training is reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from broker.core.learned import FEATURES, HEURISTIC, LearnedPolicy
from broker.core.params import PlacementParams
from sluicegate.twin.nodes import Change, Result, Strategy
from sluicegate.twin.sim import replay
from sluicegate.twin.trace import Trace


@dataclass(frozen=True)
class Scenario:
    """A trace and what is changed on it (the perturbation), replayed with ``seed``."""

    name: str
    trace: Trace
    change: Change
    seed: int = 0
    group: str = ""  # the trace it perturbs, for the reward's worst-trace term


@dataclass(frozen=True)
class Score:
    """One policy's figures on one scenario."""

    attainment: float
    device_s: float  # pool device-seconds: the workers' slots' compute time
    off_site: float  # share of the jobs that ran off site
    forbidden: int  # placements the policy in force denies (always 0)


def score(result: Result, off_site_workers: frozenset[str]) -> Score:
    outcomes = result.outcomes
    n = max(len(outcomes), 1)
    return Score(
        attainment=sum(o.in_time for o in outcomes) / n,
        device_s=sum(result.busy_s.values()),
        off_site=sum(o.where in off_site_workers for o in outcomes) / n,
        forbidden=result.violations,
    )


def run(scenario: Scenario, policy: LearnedPolicy | None, strategy: Strategy = "ours") -> Result:
    change = replace(scenario.change, learned=policy, strategy=strategy)
    return replay(scenario.trace, change, seed=scenario.seed)


def off_site_of(trace: Trace, campus_prefix: str = "campus/") -> frozenset[str]:
    return frozenset(w.id for w in trace.header.workers if not w.zone.startswith(campus_prefix))


@dataclass(frozen=True)
class Weights:
    """How the reward trades attainment against pool device-seconds and off-site use."""

    cost: float = 0.05  # attainment points given for a 100 % rise in device-seconds, /100
    off_site: float = 0.02
    worst: float = 0.0  # weight of the worst trace's attainment loss against the heuristic


def reward(
    mine: Sequence[Score], base: Sequence[Score], w: Weights, groups: Sequence[str] = ()
) -> float:
    gains = [m.attainment - b.attainment for m, b in zip(mine, base, strict=True)]
    att = np.mean(gains)
    by_trace: dict[str, list[float]] = {}
    for group, gain in zip(groups, gains, strict=False):
        by_trace.setdefault(group, []).append(gain)
    worst = min((float(np.mean(g)) for g in by_trace.values()), default=0.0)
    dev = np.mean(
        [
            m.device_s / b.device_s - 1.0 if b.device_s > 0 else 0.0
            for m, b in zip(mine, base, strict=True)
        ]
    )
    off = np.mean([m.off_site - b.off_site for m, b in zip(mine, base, strict=True)])
    return float(att - w.cost * dev - w.off_site * off + w.worst * min(0.0, worst))


def _policy(theta: np.ndarray, version: str) -> LearnedPolicy:
    weights = tuple(float(x) for x in theta[: len(FEATURES)])
    keep = float(np.clip(theta[len(FEATURES)], 0.0, 1.0))
    return LearnedPolicy(weights, keep, version)


def train(
    scenarios: Sequence[Scenario],
    *,
    rounds: int = 6,
    population: int = 12,
    elite: int = 3,
    seed: int = 0,
    weights: Weights = Weights(),
    version: str = "1",
    progress: Callable[[int, float, LearnedPolicy], None] | None = None,
) -> tuple[LearnedPolicy, float]:
    """The best policy found and its reward on ``scenarios`` (0: the heuristic's)."""
    rng = np.random.default_rng(seed)
    off = [off_site_of(s.trace) for s in scenarios]
    base = [score(run(s, None), o) for s, o in zip(scenarios, off, strict=True)]
    mean = np.array([*HEURISTIC.weights, 0.0])
    spread = np.array([0.5] * len(FEATURES) + [0.3])
    best, best_reward = HEURISTIC, 0.0
    for r in range(rounds):
        thetas = [mean] + [
            mean + spread * rng.standard_normal(mean.shape) for _ in range(population - 1)
        ]
        rewards = []
        for theta in thetas:
            policy = _policy(theta, version)
            mine = [score(run(s, policy), o) for s, o in zip(scenarios, off, strict=True)]
            rewards.append(reward(mine, base, weights, [s.group for s in scenarios]))
        order = np.argsort(rewards)[::-1]
        if rewards[order[0]] > best_reward:
            best_reward, best = rewards[order[0]], _policy(thetas[order[0]], version)
        elites = np.array([thetas[i] for i in order[:elite]])
        mean = elites.mean(axis=0)
        spread = np.maximum(elites.std(axis=0), 0.05)
        if progress is not None:
            progress(r, best_reward, best)
    trained = {
        "method": "cross-entropy",
        "rounds": rounds,
        "population": population,
        "elite": elite,
        "seed": seed,
        "scenarios": [s.name for s in scenarios],
        "reward": round(best_reward, 6),
        "cost": weights.cost,
        "off_site": weights.off_site,
        **({"worst": weights.worst} if weights.worst else {}),
    }
    return replace(best, version=version, trained=trained), best_reward


def perturbations(trace: Trace, name: str, campus_prefix: str = "campus/") -> list[Scenario]:
    """The scenarios a policy trains and is judged on for ``trace``: bursts of 2x to 6x, a
    campus worker four times slower, the off-site worker lost half-way, a slow link off
    site (each but the first on a 2x burst)."""
    workers = trace.header.workers
    on = next((w.id for w in workers if w.zone.startswith(campus_prefix)), None)
    away = next((w.id for w in workers if not w.zone.startswith(campus_prefix)), None)
    half = (trace.jobs[-1].at / 2.0) if trace.jobs else 0.0
    out = [
        Scenario(f"{name} 2x", trace, Change(burst=2)),
        Scenario(f"{name} 4x", trace, Change(burst=4)),
    ]
    out.append(Scenario(f"{name} 6x", trace, Change(burst=6)))
    if on is not None:
        out.append(
            Scenario(f"{name} 2x, {on} 4x slower", trace, Change(burst=2, degrade=((on, 4.0),)))
        )
    if away is not None:
        out.append(
            Scenario(f"{name} 2x, {away} lost", trace, Change(burst=2, fail=((away, half),)))
        )
        params = PlacementParams(link_latency_ms=(0.2, 0.5, 80.0))
        out.append(Scenario(f"{name} 2x, 80 ms off site", trace, Change(burst=2, params=params)))
    return out
