"""The placement strategies ours is compared with: round-robin and least-loaded, over the
workers the policy allows for a job and the broker's fleet shows with room (its latest
telemetry and the jobs reserved since). Pure, like the rest of the replay."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from broker.core.fleet import Fleet
from policies.evaluate import allowed
from policies.model import Policy
from sluicegate.twin.nodes import SimWorker


def with_room(
    fleet: Fleet,
    workers: Iterable[SimWorker],
    policy: Policy,
    *,
    model: str,
    data_class: str,
    origin: str,
) -> list[tuple[SimWorker, float]]:
    """(worker, load) for each live worker holding ``model`` that the policy allows and the
    fleet shows with room; load is the jobs it holds, reservations included, over capacity."""
    out = []
    for w in workers:
        state = fleet.state(w.spec.id)
        latest = state.latest if state is not None else None
        if not w.alive or model not in w.spec.models or latest is None:
            continue
        if not allowed(policy, data_class, origin, w.spec.zone).allowed:
            continue
        held = latest.queue_depth + latest.in_flight + fleet.reserved(w.spec.id)
        if held < latest.capacity:
            out.append((w, held / latest.capacity))
    return out


def choose(
    strategy: str, eligible: list[tuple[SimWorker, float]], turns: Counter[str], model: str
) -> SimWorker:
    """Round-robin (a turn per model) or the least loaded; ``eligible`` is not empty."""
    if strategy == "round-robin":
        turn = turns[model]
        turns[model] += 1
        return eligible[turn % len(eligible)][0]
    return min(eligible, key=lambda pair: pair[1])[0]
