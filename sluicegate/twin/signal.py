"""The scaling signal in a replay: what the broker's ``/metrics`` would have said each
interval, computed by the broker's own code (``broker.core.demand``).

Each tick, the placements the replay made on each pool over the interval, and its share of
the requests refused for want of a worker, fold into the smoothed arrival rate; the edges'
books of announced work, replayed from the trace's ``announced`` records as the brokers
read them from ``topics.edge_announced``, give the leading part (from ``[broker]
announce_lead_s`` before each window); and the broker's own ``PoolSignal`` makes of both
and the fleet the figures a scaler reads: desired workers, demand over capacity, the
announced jobs/s. Pure: the clock comes in as ``now``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from broker.core.demand import PoolSignal
from broker.core.fleet import Fleet
from policies.model import Policy
from sluicegate.config import BrokerSettings
from sluicegate.wire import EdgeSchedule

ANNOUNCE_LEAD_S: float = BrokerSettings.model_fields["announce_lead_s"].default


class Reading(NamedTuple):
    """One pool's scaling signal at one tick (``at``: s since the trace's start)."""

    at: float
    desired_workers: int
    ratio: float  # predicted demand over capacity
    announced_jobs_s: float


@dataclass
class Signal:
    """The scaling signal of one replay, pool by pool."""

    lead_s: float = ANNOUNCE_LEAD_S

    def __post_init__(self) -> None:
        self.schedules: dict[str, EdgeSchedule] = {}
        self.readings: dict[str, list[Reading]] = {}
        self._pools = PoolSignal(self.lead_s)

    def announced(self, schedule: EdgeSchedule) -> None:
        """An edge's book, whole (no windows: cleared)."""
        if schedule.windows:
            self.schedules[schedule.node] = schedule
        else:
            self.schedules.pop(schedule.node, None)

    def tick(
        self,
        now: float,
        t0: float,
        interval: float,
        placed: Mapping[str, int],
        turned_away: Mapping[tuple[str, str], int],
        fleet: Fleet,
        policy: Policy,
    ) -> None:
        """The readings at ``now``; ``placed``: the placements per pool since the last,
        ``turned_away``: the requests refused for want of a worker, by (data class, origin
        zone)."""
        self._pools.tick(placed, turned_away, policy, interval)
        at = round(now - t0, 3)
        for d in self._pools.demand(fleet, policy, self.schedules.values(), now):
            reading = Reading(at, d.desired_workers, d.ratio, round(d.announced_jobs_s, 3))
            self.readings.setdefault(d.pool, []).append(reading)
