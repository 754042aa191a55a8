"""The placement decision by brute force: every worker, every rule, recomputed from scratch.

This is the specification the fast path (``broker.core.placement``) is tested against, and the
baseline the placement benchmark runs beside it. It reads only the fleet's frozen
:class:`~broker.core.state.WorkerState` values, its reservation counts and its learned service
times; it recomputes zones, verdicts, health, forecasts and keys itself, so a bug in the
index's incremental bookkeeping shows up as a difference. It shares with the fast path
only the rule definitions (``broker.core.scoring``, ``broker.core.forecast``) and the conclusion
(``broker.core.explain``). O(workers) per decision; never use it on the hot path.
"""

from __future__ import annotations

from broker.core.decision import Candidate, Decision, Summary
from broker.core.explain import conclude, conclude_learned
from broker.core.fleet import Fleet
from broker.core.forecast import forecast
from broker.core.links import link_class
from broker.core.params import PlacementParams
from broker.core.scoring import (
    ELIGIBLE,
    NO_NEEDS,
    OFFLINE,
    STATUS_NAMES,
    SUBHEALTHY,
    classify,
    free_at_ms,
    load_key,
    needs_of,
    transfer_costs,
    wait_at,
)
from broker.core.state import model_key
from policies.evaluate import allowed
from policies.model import Policy, Verdict
from policies.subhealth import is_subhealthy
from sluicegate.vision.manifest import Requirements
from sluicegate.wire_pool import PlacementRequest


def decide_reference(
    fleet: Fleet,
    request: PlacementRequest,
    policy: Policy,
    *,
    now: float,
    params: PlacementParams,
    requirements: dict[str, Requirements] | None = None,
) -> Decision:
    """Same contract as ``broker.core.placement.decide``; ``requirements`` are the model
    requirements the fleet was built with (none: the fleet's own)."""
    fleet.use_policy(policy)
    fleet.expire(now, params.stale_after_s)
    needs = needs_of(requirements) if requirements is not None else fleet.index.needs
    need = needs.get(request.model, NO_NEEDS)
    tx = transfer_costs(request.payload_bytes, params)
    fparams = fleet.params
    wanted = model_key(request.model, request.model_sha256)
    counts = dict.fromkeys((*STATUS_NAMES, "policy", "no_model", "not_in_policy"), 0)
    scored: list[tuple[bool, float, float, str, Candidate]] = []
    denied: dict[str, Verdict] = {}
    for state in fleet.states():
        caps = state.capabilities
        if caps is None:
            continue
        sample = state.latest
        live = state.online and sample is not None
        zone = policy.worker_zone(state.worker_id)
        if zone is None:
            counts["not_in_policy"] += live and wanted in caps.models
            continue
        verdict = allowed(policy, request.data_class, request.origin_zone, zone)
        if wanted not in caps.models:
            counts["no_model"] += live and verdict.allowed
            continue
        reserved = fleet.reserved(state.worker_id)
        sub = bool(
            sample is not None
            and policy.subhealth
            and is_subhealthy(policy.subhealth, sample.metrics()).subhealthy
        )
        full = fleet.marked_full(state.worker_id)
        cordoned = fleet.cordoned(state.worker_id)
        status = classify(caps, sample, state.online, reserved, need, zone, sub, full, cordoned)
        if not verdict.allowed:
            if status != OFFLINE:
                counts["policy"] += 1
                denied[zone] = verdict
            continue
        counts[STATUS_NAMES[status]] += 1
        if status not in ELIGIBLE or sample is None:
            continue
        outlook = forecast(state.samples, reserved, fparams)
        placed = fleet.placed(state.worker_id)
        free = free_at_ms(sample, placed, caps.concurrency, fparams.default_service_ms)
        since = sample.received_at * 1000.0
        key = load_key(free, since, outlook.crosses, fparams.forecast_penalty)
        transfer = tx[link_class(request.origin_zone, zone, params.campus_prefix)]
        service = fleet.service.estimate(request.model, caps.device_class)
        base = wait_at(free, now * 1000.0)
        score = transfer + service + wait_at(key, now * 1000.0)
        predicted = transfer + service + base
        candidate = Candidate(
            worker_id=state.worker_id,
            zone=zone,
            device_class=caps.device_class,
            score_ms=score,
            predicted_ms=predicted,
            transfer_ms=transfer,
            queue_ms=base,
            service_ms=service,
            penalty_ms=score - predicted,
            load=outlook.load_now,
            forecast_load=outlook.predicted,
            subhealthy=status == SUBHEALTHY,
        )
        scored.append((status == SUBHEALTHY, score, key, state.worker_id, candidate))
    scored.sort(key=lambda s: s[:4])
    ranked = [s[4] for s in scored if s[0] == scored[0][0]][: params.top_k] if scored else []
    if ranked and params.learned is not None:
        summary = Summary.of(counts)
        return conclude_learned(request, now, ranked, summary, params.learned, params.campus_prefix)
    return conclude(
        request,
        policy,
        now=now,
        ranked=ranked,
        summary=Summary.of(counts),
        denied=[denied[z] for z in sorted(denied)],
        allowed_zones=tuple(
            z
            for z in sorted(policy.zones)
            if allowed(policy, request.data_class, request.origin_zone, z).allowed
        ),
        need=need,
        known_models=sorted(
            {m for s in fleet.states() if s.capabilities for m in s.capabilities.models}
        ),
    )
