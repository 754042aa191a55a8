"""The placement decision: which worker, within the policy, will finish this job soonest.

    decision = decide(fleet, request, policy, now=now, params=params)
    if isinstance(decision, Placed):
        fleet.reserve(decision.worker_id, request.job_id, now, request.model)  # then the token

Filters (a worker is a candidate only if all hold): the policy allows the job's data class
from its origin zone in the worker's zone (deny wins, unknown zones denied); the worker is
online and heard from within ``stale_after_s``; it has the model loaded; it has one of the
execution providers the model accepts and enough free memory; its declared zone is its
pool's zone in the policy; it has room (queued + running + reserved < capacity).
Sub-healthy workers (the policy's rules over their latest telemetry) are candidates only
when no healthy one is. With ``sealable`` (a confidential class: ``broker.core.sealing``),
the ranked candidates it rejects are dropped, and a job none of them can be sealed for is
refused ``seal_unavailable``. The best candidate has the lowest score (``broker.core.scoring``), or
comes first in a learned policy's order (``broker.core.learned``, which sees only the
candidates every filter passed); it is taken only if it meets the deadline or beats the
edge's own estimate (``broker.core.explain``).

The fast path never looks at every worker: the fleet index keeps, per (model, zone, device
class) bucket, its workers sorted by key; a route caches which buckets the policy allows for
(data class, origin zone, model), grouped by link and device class. A decision reads the
first entry of each allowed bucket, skipping whole groups whose lowest possible score cannot
enter the top ``top_k``, then looks ``top_k`` deep into the best buckets for the ranking.
``broker.core.reference.decide_reference`` is the same decision by brute force, for tests and
the benchmark's baseline.

Pure and synchronous: the clock is ``now``; the only writes are to the fleet's caches and
its expiry of silent workers. Never imports asyncio, paho, redis or aiohttp.
"""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Callable

from broker.core.decision import Candidate, Candidates, Decision, Placed, Refused, as_record
from broker.core.explain import conclude, conclude_learned, conclude_ranked
from broker.core.fleet import Fleet
from broker.core.index import Bucket, Route, Slot
from broker.core.params import PlacementParams
from broker.core.scoring import NO_NEEDS, OFFLINE, transfer_costs, wait_at
from broker.core.sealing import SEAL_UNAVAILABLE
from broker.core.state import model_key
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

# (score, key, worker id, slot, bucket, transfer ms, service ms)
_Scored = tuple[float, float, str, Slot, Bucket, float, float]


def _scan(
    route: Route,
    tx: tuple[float, float, float],
    services: dict[str, float],
    sub: bool,
    k: int,
    now_ms: float,
) -> list[_Scored]:
    """The best ``k`` workers of one tier, best first, by (score, key, worker id).

    Groups are visited in order of their lowest possible score (transfer + service: the
    wait there is at least 0), and a group that cannot beat the ``k``-th best so far is
    skipped. In a bucket, entries are read in order only while they can still enter the
    best ``k``."""
    groups = route.groups
    model = route.model
    order = sorted([(tx[g.link] + services[g.device_class], i) for i, g in enumerate(groups)])
    top: list[_Scored] = []
    cut = math.inf
    for floor, i in order:
        if floor > cut:
            break
        group = groups[i]
        transfer = tx[group.link]
        service = services[group.device_class]
        for tier in group.sub if sub else group.healthy:
            if not tier:
                continue
            key, worker_id, slot = tier[0]
            score = transfer + service + (key - now_ms if key > now_ms else 0.0)
            if score > cut:
                continue
            bucket = slot.statuses[model][0]
            j = 0
            while True:
                insort(top, (score, key, worker_id, slot, bucket, transfer, service))
                if len(top) >= k:
                    del top[k:]
                    cut = top[-1][0]
                j += 1
                if j >= k or j >= len(tier):
                    break
                key, worker_id, slot = tier[j]
                score = transfer + service + (key - now_ms if key > now_ms else 0.0)
                if score > cut:
                    break
    return top


def _candidate(item: _Scored, now_ms: float) -> Candidate:
    score, _, worker_id, slot, bucket, transfer, service = item
    wait = wait_at(slot.free, now_ms)
    predicted = transfer + service + wait
    sample = slot.sample
    load = (
        (sample.queue_depth + sample.in_flight + slot.reserved) / sample.capacity
        if sample is not None
        else math.inf
    )
    return Candidate(
        worker_id,
        bucket.zone,
        bucket.device_class,
        score,
        predicted,
        transfer,
        wait,
        service,
        score - predicted,
        load,
        slot.predicted,
        slot.health.subhealthy,
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
    sealable: Callable[[str], bool] | None = None,
) -> Decision:
    """Where ``request`` should run under ``policy`` at ``now``; see the module docstring.
    ``params.learned``: a learned placement policy orders the candidates that passed every
    filter, and may keep the job on its edge (``broker.core.learned``).

    Syncs the fleet to ``policy`` (cheap when unchanged) and takes offline any worker
    silent for more than ``params.stale_after_s`` before deciding.
    """
    fleet.use_policy(policy)
    fleet.expire(now, params.stale_after_s)
    index = fleet.index
    model = request.model
    route = index.route(
        policy,
        request.data_class,
        request.origin_zone,
        model_key(model, request.model_sha256),
        params.campus_prefix,
    )
    tx = transfer_costs(request.payload_bytes, params)
    table = fleet.service.table(model)
    default = fleet.service.default_ms
    services = {g.device_class: table.get(g.device_class, default) for g in route.groups}
    k = params.top_k
    sub = False
    now_ms = now * 1000.0
    top = _scan(route, tx, services, sub, k, now_ms)
    if not top:
        sub = True
        top = _scan(route, tx, services, sub, k, now_ms)
    summary = index.summary(route)
    if top and sealable is not None:
        kept = [item for item in top if sealable(item[2])]
        if not kept:
            ranked = tuple(_candidate(item, now_ms) for item in top)
            return Refused(
                SEAL_UNAVAILABLE,
                f"class {request.data_class!r} is confidential: its images travel only sealed "
                "to the worker's key, and none of the best workers for it ("
                + ", ".join(c.worker_id for c in ranked)
                + ") advertises a sealing key the policy lists for it; the job runs on the edge",
                Candidates(ranked, summary.eligible, summary.filtered),
            )
        top = kept
    if top:
        # Placed or no_faster_worker: neither needs the refusal context below.
        order = [_candidate(item, now_ms) for item in top]
        if params.learned is not None:
            prefix = params.campus_prefix
            return conclude_learned(request, now, order, summary, params.learned, prefix)
        return conclude_ranked(request, now, order, summary)
    return conclude(
        request,
        policy,
        now=now,
        ranked=(),
        summary=summary,
        denied=_denied(route),
        allowed_zones=route.allowed_zones,
        need=index.needs.get(model, NO_NEEDS),
        known_models=fleet.models(),
    )
