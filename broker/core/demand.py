"""Predicted demand per pool, the signal an autoscaler (KEDA/HPA via Prometheus) sizes
pools by.

For each pool of the policy: how many jobs per second its online workers can serve
(concurrency over the mean learned service time of their models), how many it is asked
for (the arrival rate the shell measured, plus the backlog the load forecast expects at
the horizon, to be cleared within one horizon), their ratio, and how many workers would
serve that demand at a target utilisation. Work the lines announced (``sluicegate.schedule``)
leads it: :func:`announced_per_pool` spreads each edge's announced overflow, from a lead
time before its window until its end, over the pools its data class may reach from the
edge's zone, and a pool's arrivals count as the larger of the measured and the announced
rate, so the signal rises before the burst and the measured rate takes over once it is
there. Work turned away for want of a worker counts too (:func:`turned_away_per_pool`): a
pool scaled to zero, or full, is still asked for, so the signal wakes it. Pure: the shell
passes the arrival rates it counted, the refusals and the announcements it holds; this
module only does arithmetic over the fleet; it never scales anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from broker.core import forecast as fc
from broker.core import service_rules
from broker.core.fleet import Fleet
from broker.core.params import ServiceParams
from broker.core.state import WorkerState
from broker.errors import InvalidParams
from policies.evaluate import allowed
from policies.model import Policy
from sluicegate.schedule import overflow_per_s
from sluicegate.wire import EdgeSchedule

# Refusals of work a worker would have taken had there been one free: demand on the pools.
WANTED = frozenset({"no_worker", "no_capacity"})
# Demand under a job a minute asks for no worker: a smoothed rate decays toward zero without
# reaching it, and one request long ago would otherwise hold a pool at a worker for ever.
IDLE_JOBS_S = 1.0 / 60.0


@dataclass(frozen=True, slots=True)
class PoolDemand:
    pool: str
    zone: str
    workers: int  # declared in the policy
    online: int
    slots: int  # jobs the online workers can hold (sum of capacity)
    held: int  # jobs they hold now: queued + running + reserved
    capacity_jobs_s: float  # jobs/s the online workers serve when busy
    demand_jobs_s: float  # arrivals + forecast backlog cleared within the horizon
    load: float  # held / slots
    forecast_load: float  # expected held / slots at the horizon
    ratio: float  # demand / capacity; inf when there is demand and no capacity
    desired_workers: int  # to serve the demand at the target utilisation
    announced_jobs_s: float = 0.0  # the lines' announced overflow counted for it now


def worker_rate(fleet: Fleet, state: WorkerState) -> float:
    """Jobs/s a worker serves when busy: concurrency over its models' mean service time."""
    caps = state.capabilities
    if caps is None or not caps.names:
        return 0.0
    mean_ms = sum(fleet.service.estimate(m, caps.device_class) for m in caps.names) / len(
        caps.names
    )
    return caps.concurrency * 1000.0 / mean_ms


def pool_demand(
    fleet: Fleet,
    policy: Policy,
    *,
    arrivals_per_s: Mapping[str, float],
    announced_per_s: Mapping[str, float] | None = None,
    horizon_s: float | None = None,
    target_utilisation: float = 0.7,
) -> tuple[PoolDemand, ...]:
    """Demand against capacity for every pool of ``policy``, in pool-name order.
    ``arrivals_per_s``: jobs/s placed on (or meant for) each pool, by pool name;
    ``announced_per_s``: what the lines announced for it (:func:`announced_per_pool`)."""
    announced = announced_per_s or {}
    if not 0.0 < target_utilisation <= 1.0:
        raise InvalidParams(f"target_utilisation = {target_utilisation!r}; accepted: 0 < t <= 1")
    horizon = horizon_s if horizon_s is not None else fleet.params.forecast_horizon_s
    out = []
    for pool in sorted(policy.pools, key=lambda p: p.name):
        states = [s for w in pool.workers if (s := fleet.state(w)) is not None]
        online = [s for s in states if s.placeable]
        slots = held = 0
        expected = capacity = 0.0
        for state in online:
            sample = state.samples[-1]
            reserved = fleet.reserved(state.worker_id)
            outlook = fc.forecast(state.samples, reserved, fleet.params)
            slots += sample.capacity
            held += sample.queue_depth + sample.in_flight + reserved
            expected += outlook.predicted * sample.capacity
            capacity += worker_rate(fleet, state)
        ahead = announced.get(pool.name, 0.0)
        arriving = max(arrivals_per_s.get(pool.name, 0.0), ahead)
        demand = arriving + (expected / horizon if horizon > 0 else 0.0)
        known = [r for s in states if (r := worker_rate(fleet, s)) > 0.0]
        per_worker = sum(known) / len(known) if known else 0.0
        if demand < IDLE_JOBS_S:
            desired = 0
        elif per_worker > 0.0:
            desired = math.ceil(demand / (per_worker * target_utilisation))
        else:
            desired = len(pool.workers)
        out.append(
            PoolDemand(
                pool=pool.name,
                zone=pool.zone,
                workers=len(pool.workers),
                online=len(online),
                slots=slots,
                held=held,
                capacity_jobs_s=capacity,
                demand_jobs_s=demand,
                load=held / slots if slots else 0.0,
                forecast_load=expected / slots if slots else 0.0,
                ratio=demand / capacity if capacity > 0 else (math.inf if demand > 0 else 0.0),
                desired_workers=desired,
                announced_jobs_s=ahead,
            )
        )
    return tuple(out)


def announced_per_pool(
    schedules: Iterable[EdgeSchedule], policy: Policy, now: float, lead_s: float
) -> dict[str, float]:
    """Jobs/s the lines' announced work will send to each pool: each window's overflow (its
    rate beyond what its edge runs itself), from ``lead_s`` before it starts until it ends,
    split evenly over the pools of the zones its data class may reach from the edge's zone
    (as the policy lists the edge: a schedule from an edge it does not list counts for
    nothing)."""
    out: dict[str, float] = {}
    for doc in schedules:
        edge = policy.edge(doc.node)
        if edge is None:
            continue
        for window in doc.windows:
            extra = overflow_per_s((window,), now, lead_s)
            if extra > 0.0:
                _spread(out, extra, _pools_for(policy, window.data_class, edge.zone))
    return out


def fold_arrivals(
    arrivals: Mapping[str, float],
    placed: Mapping[str, int],
    turned_away: Mapping[tuple[str, str], int],
    policy: Policy | None,
    interval_s: float,
    params: ServiceParams,
) -> dict[str, float]:
    """Each pool's smoothed arrival rate after one tick of ``interval_s``: the placements
    on it (``placed``, by pool) and its share of the requests turned away for want of a
    worker (:func:`turned_away_per_pool`) over the tick, folded into ``arrivals``
    (``service_rules.arrivals``). The broker's housekeeping and the twin's signal both tick
    with it."""
    asked: dict[str, float] = {pool: float(n) for pool, n in placed.items()}
    if policy is not None:
        for pool, n in turned_away_per_pool(turned_away, policy).items():
            asked[pool] = asked.get(pool, 0.0) + n
    return {
        pool: service_rules.arrivals(arrivals.get(pool), asked.get(pool, 0.0) / interval_s, params)
        for pool in set(arrivals) | set(asked)
    }


@dataclass
class PoolSignal:
    """The pools' scaling signal as one broker keeps it, tick by tick: the arrival rates it
    folds (:func:`fold_arrivals`), and on asking each pool's demand against capacity, the
    lines' announced work (from ``lead_s`` before each window) leading it. The broker's
    shell and the twin's replay each keep one."""

    lead_s: float
    params: ServiceParams = field(default_factory=ServiceParams)
    arrivals: dict[str, float] = field(default_factory=dict)

    def tick(
        self,
        placed: Mapping[str, int],
        turned_away: Mapping[tuple[str, str], int],
        policy: Policy | None,
        interval_s: float,
    ) -> None:
        """One tick: the placements per pool and the refusals for want of a worker since
        the last."""
        self.arrivals = fold_arrivals(
            self.arrivals, placed, turned_away, policy, interval_s, self.params
        )

    def demand(
        self, fleet: Fleet, policy: Policy, schedules: Iterable[EdgeSchedule], now: float
    ) -> tuple[PoolDemand, ...]:
        """Each pool's demand against capacity at ``now`` (:func:`pool_demand`)."""
        ahead = announced_per_pool(schedules, policy, now, self.lead_s)
        return pool_demand(fleet, policy, arrivals_per_s=self.arrivals, announced_per_s=ahead)


def turned_away_per_pool(
    turned_away: Mapping[tuple[str, str], int], policy: Policy
) -> dict[str, float]:
    """The requests refused for want of a worker (``no_worker``, ``no_capacity``), counted
    by (data class, origin zone), as demand on the pools they could have gone to: each split
    evenly over the pools of the zones the policy lets its data class reach from its origin
    (none: it counts for nothing). Whether a pool's workers would hold the model is not
    known of a pool scaled to zero, so every such pool counts."""
    out: dict[str, float] = {}
    for (data_class, zone), n in turned_away.items():
        _spread(out, float(n), _pools_for(policy, data_class, zone))
    return out


def _pools_for(policy: Policy, data_class: str, origin_zone: str) -> list[str]:
    return [
        p.name for p in policy.pools if allowed(policy, data_class, origin_zone, p.zone).allowed
    ]


def _spread(out: dict[str, float], amount: float, pools: list[str]) -> None:
    for name in pools:
        out[name] = out.get(name, 0.0) + amount / len(pools)
