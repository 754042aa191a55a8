"""The gauges ``/metrics`` refreshes at scrape time, from the running broker's fleet view,
its edges' telemetry and the policy in force: workers by health state, the workers' queue
depths, the edges' queued and finished jobs summed by policy zone (per edge they are on
each edge's own ``/metrics``; thousands of edges would be thousands of series here, and a
slow scrape on the event loop) and the offload ratio, each pool's predicted demand with the
age of the telemetry it rests on, when each worker last reported, the policy's version
and expiry, and each sister campus's standing, offered slots and link.

Reads only; it sets gauges and changes nothing of the broker. ``signal_ages`` is plain
arithmetic over the fleet view, kept apart so the tests and the docs can reason about a
scaling signal's freshness without a broker.
"""

from __future__ import annotations

import math
from collections import Counter

from broker.core.demand import PoolDemand
from broker.core.fleet import Fleet
from broker.edge_fleet import EdgeRow
from broker.metrics import BrokerMetrics
from policies.model import Policy


def signal_ages(fleet: Fleet, policy: Policy, now: float) -> dict[str, float]:
    """Per pool of ``policy``: seconds since this broker received the newest telemetry of
    any of the pool's workers (``inf`` when none has reported to it yet)."""
    ages: dict[str, float] = {}
    for pool in policy.pools:
        newest = max(
            (
                s.latest.received_at
                for w in pool.workers
                if (s := fleet.state(w)) is not None and s.latest is not None
            ),
            default=None,
        )
        ages[pool.name] = math.inf if newest is None else max(0.0, now - newest)
    return ages


def refresh(
    m: BrokerMetrics,
    fleet: Fleet,
    edges: dict[str, EdgeRow],
    demand: tuple[PoolDemand, ...],
    policy: Policy | None,
    now: float,
    peers: dict[str, tuple[bool, int, float | None]] | None = None,
) -> None:
    """Set every scrape-time gauge of ``m``; ``peers``: ``Peers.facts()``."""
    for peer, (in_force, free, rtt) in (peers or {}).items():
        m.peer_in_force.labels(peer).set(1.0 if in_force else 0.0)
        m.peer_free_slots.labels(peer).set(free)
        m.peer_rtt.labels(peer).set(rtt if rtt is not None else math.nan)
    states: Counter[str] = Counter()
    for state in fleet.states():
        view = fleet.view(state.worker_id)
        if not state.online:
            states["offline"] += 1
        elif view is not None and view.health.subhealthy:
            states["subhealthy"] += 1
        else:
            states["healthy"] += 1
        latest = state.latest
        if latest is not None:
            m.queue_depth.labels(state.worker_id, "pool").set(latest.queue_depth)
            m.worker_last_seen.labels(state.worker_id).set(latest.received_at)
    for name in ("healthy", "subhealthy", "offline"):
        m.workers.labels(name).set(states[name])
    listed = {e.edge_id: e.zone for e in policy.edges} if policy is not None else {}
    queued: Counter[str] = Counter()
    finished: Counter[tuple[str, str]] = Counter()
    for tel in edges.values():
        zone = listed.get(tel.node, tel.zone)
        queued[zone] += tel.queue_depth
        finished[zone, "edge"] += tel.finished_edge
        finished[zone, "pool"] += tel.finished_pool
    for zone, depth in queued.items():
        m.edge_queued.labels(zone).set(depth)
    for (zone, ran_on), jobs in finished.items():
        m.finished.labels(zone, ran_on).set(jobs)
    local = sum(finished[zone, "edge"] for zone in queued)
    offloaded = sum(finished[zone, "pool"] for zone in queued)
    m.offload_ratio.set(offloaded / (offloaded + local) if offloaded + local else 0.0)
    for pool in demand:
        m.demand.labels(pool.pool).set(pool.ratio)
        m.desired_workers.labels(pool.pool).set(pool.desired_workers)
        m.announced.labels(pool.pool).set(pool.announced_jobs_s)
    m.policy_version.set(policy.version if policy is not None else 0)
    m.policy_expiry.set(policy.expires if policy is not None else 0)
    if policy is not None:
        for name, age in signal_ages(fleet, policy, now).items():
            m.signal_age.labels(name).set(age)
