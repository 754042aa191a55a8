"""The hindsight oracle: the bound a placement policy is measured against in the twin.

No policy can know the future; the twin can. The oracle replays a scenario second by second
and, before each step, tries every placement rule it is given (today's heuristic, a learned
policy, least-loaded, round-robin, edge-only) on a copy of the whole replay, the real future
included: the arrivals still to come and the service times the replay's seeded draws will
give them. Each copy runs its rule for the next ``horizon_s`` of arrivals, and until those
arrivals' deadlines have passed; the rule under which most of them meet their deadline (on
a tie, the one using fewest pool device-seconds, then the first given) places the jobs of
the next ``step_s``. So it is a greedy with lookahead over rules, with perfect foresight:
each step it does as well as the best rule would from there, and it switches rule whenever
the future says another does better (a burst about to arrive, a worker about to slow).

It is an estimate of the best placement, not a proof of it: it chooses among rules, not
among every assignment of jobs to workers, and it looks ``horizon_s`` ahead, not to the
end. A policy that beats it on a scenario shows it; ``bench/learned_placement.py`` prints
where that happens. Pure but for its time (a copy per rule per step); seeded like the rest
of the replay, so the same scenario gives the same result.
"""

from __future__ import annotations

import bisect
import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from broker.core.learned import LearnedPolicy
from broker.core.params import PlacementParams
from sluicegate.twin.nodes import Change, Result, Strategy
from sluicegate.twin.sim import Simulation
from sluicegate.twin.trace import Trace


@dataclass(frozen=True)
class Rule:
    """One placement rule the oracle may choose for a step."""

    name: str
    strategy: Strategy = "ours"
    learned: LearnedPolicy | None = None


def rules_of(policy: LearnedPolicy | None) -> tuple[Rule, ...]:
    """The heuristic first (it wins ties), then the learned policy when there is one, then
    the simple strategies."""
    learned = (Rule("learned", "ours", policy),) if policy is not None else ()
    simple = tuple(Rule(s, s) for s in ("least-loaded", "round-robin", "edge-only"))
    return (Rule("heuristic"), *learned, *simple)


@dataclass(frozen=True)
class Hindsight:
    """The oracle's replay, and how many steps each rule placed."""

    result: Result
    chosen: dict[str, int]


def hindsight(
    trace: Trace,
    change: Change,
    rules: Sequence[Rule],
    *,
    seed: int = 0,
    step_s: float = 1.0,
    horizon_s: float = 2.0,
) -> Hindsight:
    """Replay ``trace`` under ``change``, each step placed by the rule the future favours."""
    sim = Simulation(trace, replace(change, strategy="ours", learned=None), seed=seed)
    base = sim.params
    arrivals = [a.at for a in sim.arrivals]
    settle = max((a.deadline - a.at for a in sim.arrivals if a.deadline is not None), default=0.0)
    chosen: Counter[str] = Counter()
    sim.start()
    t = sim.t0
    last = arrivals[-1] if arrivals else t
    while t <= last:
        lo, hi = bisect.bisect_left(arrivals, t), bisect.bisect_left(arrivals, t + horizon_s)
        rule = rules[0]
        if hi > lo:  # arrivals ahead: a choice to make
            rule = _best(sim, rules, base, t, horizon_s, settle)
        chosen[rule.name] += 1
        _use(sim, rule, base)
        sim.advance(t + step_s)
        t += step_s
    _use(sim, rules[0], base)
    sim.advance(float("inf"))
    return Hindsight(sim.result(), dict(chosen))


def _best(
    sim: Simulation,
    rules: Sequence[Rule],
    base: PlacementParams,
    t: float,
    horizon_s: float,
    settle_s: float,
) -> Rule:
    """The rule under which most arrivals of ``[t, t + horizon_s)`` meet their deadline, on
    a copy of ``sim`` run on to when the last of them is due."""
    lo, hi = t - sim.t0, t - sim.t0 + horizon_s
    best: tuple[tuple[int, float], Rule] | None = None
    for rule in rules:
        fork = copy.deepcopy(sim, {id(sim.arrivals): sim.arrivals})
        _use(fork, rule, base)
        seen, asked = len(fork.events.outcomes), fork.events.broker.asked
        busy = sum(w.busy_s for w in fork.workers.values())
        fork.advance(t + horizon_s + settle_s)
        if best is None and fork.events.broker.asked == asked:
            return rule  # the first rule asked for no placement: every rule does the same
        met = sum(o.in_time for o in fork.events.outcomes[seen:] if lo <= o.at < hi)
        spent = sum(w.busy_s for w in fork.workers.values()) - busy
        key = (met, -spent)
        if best is None or key > best[0]:
            best = (key, rule)
    assert best is not None  # rules is not empty
    return best[1]


def _use(sim: Simulation, rule: Rule, base: PlacementParams) -> None:
    """From now on ``sim`` places by ``rule``."""
    broker = sim.events.broker
    broker.change = replace(broker.change, strategy=rule.strategy, learned=rule.learned)
    broker.params = replace(base, learned=rule.learned) if rule.learned else base
