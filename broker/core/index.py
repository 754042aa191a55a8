"""The fleet index: workers grouped and ordered so a decision touches only group heads.

A *bucket* is one (model, zone, device class): every worker of that device class whose
zone (as the policy declares it) is that zone and that has the model loaded. Inside a
bucket, eligible workers sit in two sorted lists, healthy and sub-healthy, ordered by
their *key* (``scoring.load_key``: the instant the work ahead there runs out, on the
broker's clock in ms, later by the forecast penalty), then worker id. Keys are instants, so
the order holds as the clock runs: at ``now`` a worker's wait is ``max(0, key - now)``, and
of two workers both free the one free longer comes first. All workers of a bucket share the
transfer cost and the service time of a request, so the first healthy entry is the
bucket's best worker. Each bucket also counts
its workers by status, so explanations need no scan.

A change to a worker (telemetry, reservation) moves its entry in each of its buckets:
a binary search, a delete and an insert, O(log n) comparisons plus a memmove of a list
that holds one bucket's workers. A *route* caches, per (data class, origin zone, model),
the buckets the policy allows, grouped by link and device class, and the ones it denies;
it is rebuilt when a bucket appears or the policy changes.

Mutable, but pure: no clock, no I/O. Only ``broker.core.fleet`` writes to it and only
``broker.core.placement`` reads routes and heads; it must never decide anything itself.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass, field

from broker.core import forecast
from broker.core.decision import Summary
from broker.core.links import link_class
from broker.core.params import FleetParams
from broker.core.scoring import (
    CORDONED,
    NO_NEEDS,
    OFFLINE,
    OK,
    SUBHEALTHY,
    Need,
    Placement,
    after_placing,
    classify,
    free_at_ms,
    load_key,
    step_ms,
)
from broker.core.state import Capabilities, TelemetrySample, WorkerState, model_name
from policies.evaluate import allowed
from policies.model import Policy, Verdict
from policies.subhealth import HealthVerdict, is_subhealthy

HEALTHY = HealthVerdict(False, None)
ROUTE_CACHE_LIMIT = 4096
N_STATUS = 8


class Slot:
    """The index's working copy of one worker: what the hot path reads."""

    __slots__ = (
        "caps",
        "cordoned",
        "crosses",
        "free",
        "health",
        "key",
        "marked_full",
        "online",
        "predicted",
        "reserved",
        "sample",
        "slope",
        "statuses",
        "unzoned",
        "worker_id",
        "zone",
        "zone_counted",
    )

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.caps: Capabilities | None = None
        self.sample: TelemetrySample | None = None
        self.online = False
        self.zone: str | None = None  # the policy's zone for this worker
        self.reserved = 0
        self.marked_full = False
        self.cordoned = False  # an operator took it out of placement
        self.slope = 0.0
        self.health = HEALTHY
        self.free = math.inf  # when the work ahead there runs out, ms (scoring.free_at_ms)
        self.key = math.inf
        self.predicted = 0.0
        self.crosses = False
        self.statuses: dict[str, tuple[Bucket, int]] = {}
        self.unzoned: tuple[str, ...] = ()  # models counted as "not in any pool"
        self.zone_counted: str | None = None  # zone whose online count includes this worker


# (key, worker id, slot): ordered by key, then worker id (one entry per worker per list).
Entry = tuple[float, str, Slot]


class Bucket:
    __slots__ = ("counts", "device_class", "healthy", "model", "sub", "totals", "zone")

    def __init__(self, model: str, zone: str, device_class: str, totals: list[int]) -> None:
        self.model = model
        self.zone = zone
        self.device_class = device_class
        self.healthy: list[Entry] = []
        self.sub: list[Entry] = []
        self.counts = [0] * N_STATUS
        self.totals = totals  # shared by the model's buckets in this zone (every class)

    def tier(self, status: int) -> list[Entry] | None:
        """The sorted list a worker with ``status`` sits in, if any."""
        if status == OK:
            return self.healthy
        return self.sub if status == SUBHEALTHY else None


@dataclass(slots=True)
class Group:
    """The allowed buckets of a route that share a link class and a device class, so
    every worker in them has the same transfer cost and service time for a request."""

    link: int
    device_class: str
    # The buckets' sorted lists; a bucket is found from an entry's slot when needed.
    healthy: list[list[Entry]] = field(default_factory=list)
    sub: list[list[Entry]] = field(default_factory=list)


@dataclass(slots=True)
class Route:
    """Buckets for one (data class, origin zone, model) under one policy."""

    data_class: str
    origin_zone: str
    model: str
    topology: int
    campus_prefix: str
    groups: list[Group]
    allowed: list[Bucket]
    denied: list[tuple[Bucket, Verdict]]
    allowed_zones: tuple[str, ...]
    # (model, zone) totals of the zones holding its allowed and its denied buckets
    allowed_totals: list[list[int]] = field(default_factory=list)
    denied_totals: list[list[int]] = field(default_factory=list)
    summary_epoch: tuple[int, int] = (-1, -1)
    summary: Summary | None = None


class PlacementIndex:
    """Buckets, per-worker slots and cached routes; see the module docstring."""

    def __init__(self, params: FleetParams, needs: dict[str, Need]) -> None:
        self.params = params
        self.needs = needs
        self.policy: Policy | None = None
        self.slots: dict[str, Slot] = {}
        self.buckets: dict[str, dict[tuple[str, str], Bucket]] = {}
        self.unzoned: dict[str, int] = {}  # per model: online workers in no pool of the policy
        self.zone_online: dict[str, int] = {}
        self.topology = 0  # bumps when a bucket appears
        self.epoch = 0  # bumps when online or unzoned counts change (every route's counts)
        self.model_epochs: dict[str, int] = {}  # bumps when a status for that model changes
        # (model, zone) -> workers by status over the model's buckets in the zone
        self.zone_totals: dict[tuple[str, str], list[int]] = {}
        self.routes: dict[tuple[str, str, str], Route] = {}

    # -- writes (from broker.core.fleet) -------------------------------------------------------

    def reset(self, policy: Policy | None, needs: dict[str, Need]) -> None:
        """Forget every slot and bucket (the fleet then re-adds each worker)."""
        self.policy = policy
        self.needs = needs
        self.slots.clear()
        self.buckets.clear()
        self.unzoned.clear()
        self.zone_online.clear()
        self.zone_totals.clear()
        self.routes.clear()
        self.topology += 1
        self.epoch += 1

    def update(
        self,
        state: WorkerState,
        reserved: int,
        marked_full: bool,
        placed: Sequence[Placement],
        cordoned: bool = False,
    ) -> None:
        """Take in a worker's new state (capabilities, telemetry, online flag); ``placed``:
        the jobs placed there since its telemetry (when, model), in order; ``cordoned``: an
        operator took it out of placement."""
        slot = self.slots.get(state.worker_id)
        if slot is None:
            slot = self.slots[state.worker_id] = Slot(state.worker_id)
        policy = self.policy
        slot.caps = state.capabilities
        slot.sample = state.latest
        slot.online = state.online
        slot.zone = policy.worker_zones.get(state.worker_id) if policy is not None else None
        slot.reserved = reserved
        slot.marked_full = marked_full
        slot.cordoned = cordoned
        params = self.params
        slot.slope = forecast.trend(state.samples, params.trend_window, params.trend_min_samples)
        if slot.sample is not None and policy is not None and policy.subhealth:
            slot.health = is_subhealthy(policy.subhealth, slot.sample.metrics())
        else:
            slot.health = HEALTHY
        self._drain(slot, placed)
        self._refresh(slot)

    def set_reserved(self, worker_id: str, reserved: int) -> None:
        """A reserved job completed: one fewer held there (its work is already behind)."""
        slot = self.slots.get(worker_id)
        if slot is not None and slot.reserved != reserved:
            slot.reserved = reserved
            self._refresh(slot)

    def add_placed(self, worker_id: str, reserved: int, when_ms: float, model: str | None) -> None:
        """A job of ``model`` was placed on the worker at ``when_ms``: held there, and queued
        behind its work (``scoring.after_placing``, O(1))."""
        slot = self.slots.get(worker_id)
        if slot is None:
            return
        slot.reserved = reserved
        caps, sample = slot.caps, slot.sample
        if caps is not None and sample is not None:
            step = step_ms(sample, model, caps.concurrency, self.params.default_service_ms)
            slot.free = after_placing(slot.free, when_ms, step)
        self._refresh(slot)

    def set_placed(self, worker_id: str, reserved: int, placed: Sequence[Placement]) -> None:
        """Jobs placed there went elsewhere after all: the work ahead is recounted."""
        slot = self.slots.get(worker_id)
        if slot is not None:
            slot.reserved = reserved
            self._drain(slot, placed)
            self._refresh(slot)

    def set_cordoned(self, worker_id: str, cordoned: bool) -> None:
        slot = self.slots.get(worker_id)
        if slot is not None and slot.cordoned != cordoned:
            slot.cordoned = cordoned
            self._refresh(slot)

    def set_marked_full(self, worker_id: str, marked_full: bool) -> None:
        slot = self.slots.get(worker_id)
        if slot is not None and slot.marked_full != marked_full:
            slot.marked_full = marked_full
            self._refresh(slot)

    def remove(self, worker_id: str) -> None:
        slot = self.slots.pop(worker_id, None)
        if slot is not None:
            slot.caps = None
            self._refresh(slot)

    # -- internals --------------------------------------------------------------------------

    def _bucket(self, model: str, zone: str, device_class: str) -> Bucket:
        by_place = self.buckets.get(model)
        if by_place is None:
            by_place = self.buckets[model] = {}
        bucket = by_place.get((zone, device_class))
        if bucket is None:
            totals = self.zone_totals.setdefault((model, zone), [0] * N_STATUS)
            bucket = by_place[(zone, device_class)] = Bucket(model, zone, device_class, totals)
            self.topology += 1
        return bucket

    def _drain(self, slot: Slot, placed: Sequence[Placement]) -> None:
        caps, sample = slot.caps, slot.sample
        if caps is None or sample is None:
            slot.free = math.inf
        else:
            default = self.params.default_service_ms
            slot.free = free_at_ms(sample, placed, caps.concurrency, default)

    def _refresh(self, slot: Slot) -> None:
        caps, sample, zone = slot.caps, slot.sample, slot.zone
        params = self.params
        statuses: dict[str, tuple[Bucket, int]] = {}
        unzoned: tuple[str, ...] = ()
        zone_counted: str | None = None
        key = math.inf
        if caps is not None and sample is not None:
            now_load = forecast.load_now(sample, slot.reserved)
            slot.predicted = forecast.predict(now_load, slot.slope, params.forecast_horizon_s)
            slot.crosses = slot.predicted >= 1.0
            since = sample.received_at * 1000.0
            key = load_key(slot.free, since, slot.crosses, params.forecast_penalty)
        if caps is not None:
            online = slot.online and sample is not None
            if zone is None:
                unzoned = caps.models if online else ()
            else:
                zone_counted = zone if online else None
                sub = slot.health.subhealthy
                for model in caps.models:  # by name, and by name and sha256
                    need = self.needs.get(model_name(model), NO_NEEDS)
                    status = classify(
                        caps,
                        sample,
                        slot.online,
                        slot.reserved,
                        need,
                        zone,
                        sub,
                        slot.marked_full,
                        slot.cordoned,
                    )
                    statuses[model] = (self._bucket(model, zone, caps.device_class), status)
        self._count(slot, unzoned, zone_counted)
        same_status = statuses == slot.statuses
        if same_status and key == slot.key:
            return
        worker_id = slot.worker_id
        for bucket, status in slot.statuses.values():
            bucket.counts[status] -= 1
            bucket.totals[status] -= 1
            tier = bucket.tier(status)
            if tier is not None:
                del tier[bisect_left(tier, (slot.key, worker_id))]
        entry: Entry = (key, worker_id, slot)
        for bucket, status in statuses.values():
            bucket.counts[status] += 1
            bucket.totals[status] += 1
            tier = bucket.tier(status)
            if tier is not None:
                insort(tier, entry)
        if not same_status:  # the counts of these models' routes changed
            epochs = self.model_epochs
            for model, (bucket, status) in statuses.items():
                if slot.statuses.get(model) != (bucket, status):
                    epochs[model] = epochs.get(model, 0) + 1
            for model in slot.statuses.keys() - statuses.keys():
                epochs[model] = epochs.get(model, 0) + 1
        slot.statuses = statuses
        slot.key = key

    def _count(self, slot: Slot, unzoned: tuple[str, ...], zone_counted: str | None) -> None:
        if unzoned != slot.unzoned:
            for model in slot.unzoned:
                self.unzoned[model] -= 1
            for model in unzoned:
                self.unzoned[model] = self.unzoned.get(model, 0) + 1
            slot.unzoned = unzoned
            self.epoch += 1
        if zone_counted != slot.zone_counted:
            if slot.zone_counted is not None:
                self.zone_online[slot.zone_counted] -= 1
            if zone_counted is not None:
                self.zone_online[zone_counted] = self.zone_online.get(zone_counted, 0) + 1
            slot.zone_counted = zone_counted
            self.epoch += 1

    # -- reads (from broker.core.placement) -----------------------------------------------------

    def route(
        self, policy: Policy, data_class: str, origin_zone: str, model: str, campus_prefix: str
    ) -> Route:
        """The cached route for a request; rebuilt when buckets appeared since."""
        rkey = (data_class, origin_zone, model)
        route = self.routes.get(rkey)
        if (
            route is not None
            and route.topology == self.topology
            and route.campus_prefix == campus_prefix
        ):
            return route
        if len(self.routes) >= ROUTE_CACHE_LIMIT:
            self.routes.clear()
        route = self._build_route(policy, data_class, origin_zone, model, campus_prefix)
        self.routes[rkey] = route
        return route

    def _build_route(
        self, policy: Policy, data_class: str, origin_zone: str, model: str, campus_prefix: str
    ) -> Route:
        verdicts = {z: allowed(policy, data_class, origin_zone, z) for z in sorted(policy.zones)}
        groups: dict[tuple[int, str], Group] = {}
        allowed_buckets: list[Bucket] = []
        denied: list[tuple[Bucket, Verdict]] = []
        for (zone, dc), bucket in sorted(self.buckets.get(model, {}).items()):
            verdict = verdicts.get(zone) or allowed(policy, data_class, origin_zone, zone)
            if not verdict.allowed:
                denied.append((bucket, verdict))
                continue
            allowed_buckets.append(bucket)
            link = link_class(origin_zone, zone, campus_prefix)
            group = groups.get((link, dc))
            if group is None:
                group = groups[(link, dc)] = Group(link, dc)
            group.healthy.append(bucket.healthy)
            group.sub.append(bucket.sub)
        return Route(
            data_class=data_class,
            origin_zone=origin_zone,
            model=model,
            topology=self.topology,
            campus_prefix=campus_prefix,
            groups=[groups[k] for k in sorted(groups)],
            allowed=allowed_buckets,
            denied=denied,
            allowed_zones=tuple(z for z, v in verdicts.items() if v.allowed),
            allowed_totals=self._totals(model, allowed_buckets),
            denied_totals=self._totals(model, [b for b, _ in denied]),
        )

    def _totals(self, model: str, buckets: list[Bucket]) -> list[list[int]]:
        zones = sorted({b.zone for b in buckets})
        return [self.zone_totals[(model, z)] for z in zones]

    def summary(self, route: Route) -> Summary:
        """Workers by reason for this route (cached until a status for its model, or an
        online or unzoned count, changes)."""
        epochs = (self.epoch, self.model_epochs.get(route.model, 0))
        if route.summary is not None and route.summary_epoch == epochs:
            return route.summary
        # Column sums over the zones' totals (a few zones rather than every bucket; zip and
        # sum run in C): a status change of any of the model's workers comes here again.
        totals = [sum(column) for column in zip(*route.allowed_totals, strict=True)]
        if not totals:
            totals = [0] * N_STATUS
        placed_online = sum(totals) - totals[OFFLINE]
        online = self.zone_online
        zone_online = sum([online.get(z, 0) for z in route.allowed_zones])
        denied = route.denied_totals
        policy = sum(map(sum, denied)) - sum([c[OFFLINE] for c in denied])
        out = {
            "eligible": totals[OK],
            "subhealthy": totals[SUBHEALTHY],
            "full": totals[2],
            "memory": totals[3],
            "provider": totals[4],
            "zone_mismatch": totals[5],
            "offline": totals[OFFLINE],
            "cordoned": totals[CORDONED],
            "policy": policy,
            "no_model": zone_online - placed_online,
            "not_in_policy": self.unzoned.get(route.model, 0),
        }
        route.summary = Summary.of(out)
        route.summary_epoch = epochs
        return route.summary
