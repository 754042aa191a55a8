"""From scored candidates and filter counts to a decision, with reasons in words.

Both the fast path (``broker.core.placement``) and the brute-force reference
(``broker.core.reference``) end here, so they cannot disagree on the acceptance rule, the
refusal codes or their sentences. The rules, in order:

1. a best candidate exists: placed if its predicted completion meets the deadline or beats
   the edge's own estimate (or the request gives neither), else ``no_faster_worker``;
2. some allowed worker with the model would fit but is full: ``no_capacity``;
3. allowed workers with the model exist but none meets the model's requirements (or their
   declared zone differs from the policy's), or an operator cordoned them: ``no_worker``;
4. online workers with the model exist only in zones the policy denies: ``policy_denied``;
5. otherwise no online worker has the model: ``no_worker``.

Pure: builds values and strings, never looks anything up but what it is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from broker.core.decision import Candidate, Candidates, Decision, Placed, Refused, Summary
from broker.core.learned import LearnedPolicy
from broker.core.scoring import Need
from policies.model import Policy, Verdict
from sluicegate.wire_pool import PlacementRequest

SHOWN = 3  # zones or models named in a sentence before "and N more"


def _names(items: Sequence[str]) -> str:
    head = ", ".join(items[:SHOWN])
    more = len(items) - SHOWN
    return f"{head} and {more} more" if more > 0 else head


def accepts(request: PlacementRequest, predicted_ms: float, now: float) -> bool:
    """Does a predicted completion justify moving the job off its edge?"""
    if request.deadline_at is None and request.local_estimate_ms is None:
        return True
    if request.deadline_at is not None and predicted_ms <= (request.deadline_at - now) * 1000.0:
        return True
    return request.local_estimate_ms is not None and predicted_ms < request.local_estimate_ms


def conclude(
    request: PlacementRequest,
    policy: Policy,
    *,
    now: float,
    ranked: Sequence[Candidate],
    summary: Summary,
    denied: Sequence[Verdict],
    allowed_zones: Sequence[str],
    need: Need,
    known_models: Sequence[str],
) -> Decision:
    """The decision for ``request`` given its best candidates (best first), the filter
    counts and the policy verdicts of denied zones that hold online workers with the model
    (sorted by zone)."""
    if ranked:
        return conclude_ranked(request, now, ranked, summary)
    cands = Candidates((), summary.eligible, summary.filtered)
    counts = summary.counts
    what = f"model {request.model!r} for data class {request.data_class!r} from zone " + repr(
        request.origin_zone
    )
    if counts.get("full", 0):
        return Refused(
            "no_capacity",
            f"all {counts['full']} workers that may run {what} are full (queued + running + "
            "reserved jobs >= capacity); the job can run as soon as one has room",
            cands,
        )
    unfit = {r: counts.get(r, 0) for r in ("provider", "memory", "zone_mismatch", "cordoned")}
    if any(unfit.values()):
        parts = []
        if unfit["provider"]:
            parts.append(f"{unfit['provider']} lack the execution provider")
        if unfit["memory"]:
            parts.append(f"{unfit['memory']} have too little free memory")
        if unfit["zone_mismatch"]:
            parts.append(
                f"{unfit['zone_mismatch']} declare a zone other than their pool's in the policy"
            )
        if unfit["cordoned"]:
            parts.append(f"{unfit['cordoned']} are cordoned by an operator (no new placements)")
        needs = "" if unfit["cordoned"] == sum(unfit.values()) else f" it needs {need.describe()};"
        return Refused(
            "no_worker",
            f"no worker may run {what}:{needs} of the {sum(unfit.values())} online workers "
            f"in allowed zones that have it, {'; '.join(parts)}",
            cands,
        )
    if counts.get("policy", 0):
        return Refused("policy_denied", _denied(request, policy, denied, allowed_zones), cands)
    return Refused("no_worker", _missing(request, counts, known_models, policy), cands)


def conclude_ranked(
    request: PlacementRequest, now: float, ranked: Sequence[Candidate], summary: Summary
) -> Decision:
    """Rule 1 alone: placed on the best candidate, or ``no_faster_worker``."""
    cands = Candidates(tuple(ranked), summary.eligible, summary.filtered)
    best = ranked[0]
    if accepts(request, best.predicted_ms, now):
        return Placed(best.worker_id, best.zone, best.predicted_ms, cands)
    return Refused("no_faster_worker", _slower(request, best, now), cands)


def conclude_learned(
    request: PlacementRequest,
    now: float,
    ranked: Sequence[Candidate],
    summary: Summary,
    learned: LearnedPolicy,
    campus_prefix: str,
) -> Decision:
    """Rule 1 with a learned placement policy: kept on the edge when the policy says so
    (``kept_local``), else placed on the policy's first, or ``no_faster_worker``."""
    if learned.keeps(request, now):
        return Refused(
            "kept_local",
            f"placement policy {learned.version} keeps the job on its edge: the edge predicts "
            f"{request.local_estimate_ms:.1f} ms there, within its deadline",
            Candidates(tuple(ranked), summary.eligible, summary.filtered),
        )
    return conclude_ranked(request, now, learned.rank(request, now, ranked, campus_prefix), summary)


def _slower(request: PlacementRequest, best: Candidate, now: float) -> str:
    limits = []
    if request.deadline_at is not None:
        limits.append(f"the deadline leaves {(request.deadline_at - now) * 1000.0:.1f} ms")
    if request.local_estimate_ms is not None:
        limits.append(f"the edge predicts {request.local_estimate_ms:.1f} ms locally")
    extra = f" + penalty {best.penalty_ms:.1f}" if best.penalty_ms else ""
    return (
        f"no worker is faster than running on the edge: the best, {best.worker_id!r} in "
        f"{best.zone!r} ({best.device_class}), predicts {best.predicted_ms:.1f} ms "
        f"(transfer {best.transfer_ms:.1f} + queue {best.queue_ms:.1f} + service "
        f"{best.service_ms:.1f}{extra}), but {' and '.join(limits)}; a job moves only when "
        "it meets its deadline there or finishes sooner than on the edge"
    )


def _why(verdict: Verdict) -> str:
    if verdict.rule is not None:
        return str(verdict.rule)
    if verdict.decision == "peer-not-agreed":
        return "the agreement with that campus does not list it"
    return "no allow rule matches"


def _denied(
    request: PlacementRequest, policy: Policy, denied: Sequence[Verdict], allowed: Sequence[str]
) -> str:
    first = denied[0]
    if first.decision == "unknown-class":
        known = ", ".join(sorted(policy.classes))
        return (
            f"data class {request.data_class!r} is not in policy v{policy.version}, so it may "
            f"go nowhere; known classes: {known}"
        )
    if first.decision == "unknown-origin":
        return (
            f"origin zone {request.origin_zone!r} is not declared in policy "
            f"v{policy.version}, so its data may go nowhere"
        )
    zones = [v.target for v in denied]
    rules = sorted({_why(v) for v in denied})
    may = f"it may go to {_names(list(allowed))}" if allowed else "it may go to no zone"
    return (
        f"policy v{policy.version} keeps data class {request.data_class!r} from "
        f"{request.origin_zone!r} out of every zone with an online worker for model "
        f"{request.model!r}: {_names(zones)} ({'; '.join(rules)}); {may}, but no online "
        "worker there has the model"
    )


def _missing(
    request: PlacementRequest, counts: Mapping[str, int], known: Sequence[str], policy: Policy
) -> str:
    text = f"no online worker has model {request.model!r}"
    sha = request.model_sha256
    if sha:
        text += f" at the edge's version (sha256 {sha[:12]}…)"
        held = [k.partition("@")[2][:12] for k in known if k.startswith(f"{request.model}@")]
        others_held = [h for h in held if not sha.startswith(h)]
        if others_held:
            text += f"; workers hold other versions of it (sha256 {', '.join(others_held)}…)"
    if counts.get("offline", 0):
        text += f" ({counts['offline']} with it are offline)"
    if counts.get("not_in_policy", 0):
        text += f" ({counts['not_in_policy']} with it are in no pool of policy v{policy.version})"
    others = [m for m in known if "@" not in m and m != request.model]
    return text + (f"; models in the fleet: {_names(others)}" if others else "")
