"""The placement decision: which worker, within the policy, will finish this job soonest.

    decision = decide(fleet, request, policy, now=now, params=params)
    if isinstance(decision, Placed):
        fleet.reserve(decision.worker_id, request.job_id, now)   # then mint the token

Filters (a worker is a candidate only if all hold): the policy allows the job's data class
from its origin zone in the worker's zone (deny wins, unknown zones denied); the worker is
online and heard from within ``stale_after_s``; it has the model loaded; it has one of the
execution providers the model accepts and enough free memory; its declared zone is its
pool's zone in the policy; it has room (queued + running + reserved < capacity).
Sub-healthy workers (the policy's rules over their latest telemetry) are candidates only
when no healthy one is. The best candidate has the lowest score (``broker.scoring``); it
is taken only if it meets the deadline or beats the edge's own estimate
(``broker.explain``).

The fast path never looks at every worker: the fleet index keeps, per (model, zone, device
class), its workers ordered by key; a route caches which of those groups the policy allows
for (data class, origin zone, model). A decision reads one heap head per allowed group.
``broker.reference.decide_reference`` is the same decision by brute force, for tests and
the benchmark's baseline.

Pure and synchronous: the clock is ``now``; the only writes are to the fleet's caches and
its expiry of silent workers. Never imports asyncio, paho, redis or aiohttp.
"""

from __future__ import annotations

import math
from bisect import insort

from broker.decision import Candidate, Candidates, Decision, Placed, Refused, as_record
from broker.explain import conclude
from broker.fleet import Fleet
from broker.index import Bucket, Entry, Route, Slot, head
from broker.params import PlacementParams
from broker.scoring import NO_NEEDS, OFFLINE, transfer_costs
from policies.model import Policy, Verdict
from sluicegate.wire_pool import PlacementRequest

__all__ = [
    "Candidate",
    "Candidates",
    "Decision",
    "Placed",
    "PlacementParams",
    "Refused",
    "as_record",
    "decide",
]

# (score, key, worker id, slot, bucket, link class, device class index)
_Scored = tuple[float, float, str, Slot, Bucket, int, int]


def _scan(
    route: Route, tx: tuple[float, float, float], sv: list[float], sub: bool, k: int
) -> list[_Scored]:
    """The best ``k`` bucket heads of one tier, best first, ordered by (score, key, id)."""
    top: list[_Scored] = []
    cut = math.inf
    for healthy, subheap, link, dci, bucket in route.allowed:
        heap = subheap if sub else healthy
        if not heap:
            continue
        entry: Entry = heap[0]
        if entry[3].stamp != entry[2]:
            fresh = head(heap)
            if fresh is None:
                continue
            entry = fresh
        key = entry[0]
        score = tx[link] + sv[dci] * key
        if score > cut:
            continue
        insort(top, (score, key, entry[1], entry[3], bucket, link, dci))
        if len(top) > k:
            top.pop()
        if len(top) == k:
            cut = top[-1][0]
    return top


def _candidate(item: _Scored, tx: tuple[float, float, float], sv: list[float]) -> Candidate:
    score, _, worker_id, slot, bucket, link, dci = item
    service = sv[dci]
    transfer = tx[link]
    predicted = transfer + service * slot.base
    sample = slot.sample
    load = (
        (sample.queue_depth + sample.in_flight + slot.reserved) / sample.capacity
        if sample is not None
        else math.inf
    )
    return Candidate(
        worker_id=worker_id,
        zone=bucket.zone,
        device_class=bucket.device_class,
        score_ms=score,
        predicted_ms=predicted,
        transfer_ms=transfer,
        queue_ms=service * (slot.base - 1.0),
        service_ms=service,
        penalty_ms=score - predicted,
        load=load,
        forecast_load=slot.predicted,
        subhealthy=slot.health.subhealthy,
    )


def _denied(route: Route) -> list[Verdict]:
    """Verdicts of denied zones that hold an online worker with the model, by zone."""
    zones: dict[str, Verdict] = {}
    for bucket, verdict in route.denied:
        if sum(bucket.counts) - bucket.counts[OFFLINE] > 0:
            zones[bucket.zone] = verdict
    return [zones[z] for z in sorted(zones)]


def decide(
    fleet: Fleet,
    request: PlacementRequest,
    policy: Policy,
    *,
    now: float,
    params: PlacementParams,
) -> Decision:
    """Where ``request`` should run under ``policy`` at ``now``; see the module docstring.

    Syncs the fleet to ``policy`` (cheap when unchanged) and takes offline any worker
    silent for more than ``params.stale_after_s`` before deciding.
    """
    fleet.use_policy(policy)
    fleet.expire(now, params.stale_after_s)
    index = fleet.index
    model = request.model
    route = index.route(
        policy, request.data_class, request.origin_zone, model, params.campus_prefix
    )
    tx = transfer_costs(request.payload_bytes, params)
    estimate = fleet.service.estimate
    sv = [estimate(model, dc) for dc in route.device_classes]
    top = _scan(route, tx, sv, False, params.top_k)
    if not top:
        top = _scan(route, tx, sv, True, params.top_k)
    counts = index.summary(route)
    ranked = [_candidate(item, tx, sv) for item in top]
    if ranked:
        # Placed or no_faster_worker: neither sentence needs the refusal context below.
        return conclude(
            request,
            policy,
            now=now,
            ranked=ranked,
            counts=counts,
            denied=(),
            allowed_zones=(),
            need=NO_NEEDS,
            known_models=(),
        )
    return conclude(
        request,
        policy,
        now=now,
        ranked=ranked,
        counts=counts,
        denied=_denied(route),
        allowed_zones=route.allowed_zones,
        need=index.needs.get(model, NO_NEEDS),
        known_models=fleet.models(),
    )
