"""From a rehearsal to a signed verdict: the candidate's figures, judged and signed.

The figures come from the candidate's replay (:class:`~sluicegate.twin.report.Summary`):
its attainment, the peak of jobs each node held, placements its own policy forbids, and,
measured against the policy *in force* (the trace's), the jobs of every data class that
policy keeps on campus which the candidate placed off site. The candidate is what the
verdict binds: a policy file (its digest and version) or a placement-parameter file (the
sha256 of its parameters' canonical JSON, ``PlacementParams.digest``). Thresholds come from the
policy in force's ``[rollout]`` table, or the defaults when it has none; a verdict for
looser thresholds than a gate requires is refused at the gate anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from broker.core.params import PlacementParams
from policies.evaluate import allowed, kept_on_site
from policies.keys import SigningKey
from policies.model import Policy
from policies.verdict import (
    Body,
    Candidate,
    Figures,
    InForce,
    Moved,
    Thresholds,
    Verdict,
    judge,
    sign_verdict,
)
from sluicegate import topics
from sluicegate.twin.nodes import Change
from sluicegate.twin.report import Move, Summary
from sluicegate.twin.trace import Trace, policy_of


def campus_only(policy: Policy, data_class: str, origin: str, zone: str) -> bool:
    """Whether ``policy`` forbids ``data_class`` from ``origin`` in ``zone`` (so a job of it
    placed there leaves what the policy in force allows)."""
    return not allowed(policy, data_class, origin, zone).allowed


MOVES_KEPT = 20  # the largest moves a verdict names


def figures_of(
    summary: Summary,
    trace: Trace,
    in_force: Summary | None = None,
    moves: Sequence[Move] = (),
) -> Figures:
    """The verdict's figures for a candidate's replay of ``trace`` and, beside them, the
    policy in force's replay of it under the same conditions (``in_force``) and the jobs the
    candidate ran elsewhere (``moves``, the largest first: ``report.compare``). Jobs placed
    off site are checked against the trace's policy per data class, from the origin zone of
    the first job of that class (the replay counts zones per class, not per origin); a job
    on a sister campus (its zone ``<zone>@<campus>``) has left the site, which breaks the
    policy in force only for a class it lets leave from none of its zones."""
    policy_in_force = policy_of(trace.header)
    params = trace.header.params
    site = (PlacementParams.from_mapping(params) if params else PlacementParams()).campus_prefix
    edge_zone = {e.id: e.zone for e in trace.header.edges}
    origins: dict[str, str] = {}
    for job in trace.jobs:
        origins.setdefault(job.data_class, edge_zone[job.edge])
    left: dict[str, dict[str, int]] = {}
    for data_class, zones in sorted(summary.zones.items()):
        origin = origins.get(data_class)
        if origin is None:
            continue
        for zone, jobs in sorted(zones.items()):
            if topics.campus_of(zone):
                kept = kept_on_site(policy_in_force, data_class, site)
            else:
                kept = campus_only(policy_in_force, data_class, origin, zone)
            if jobs and kept:
                left.setdefault(data_class, {})[zone] = jobs
    beside = None
    if in_force is not None:
        beside = InForce(
            attainment=in_force.attainment,
            by_line=dict(in_force.by_line),
            by_class=dict(in_force.by_class),
            peak_queue_depth=dict(in_force.peak_depth),
        )
    return Figures(
        attainment=summary.attainment,
        peak_queue_depth=dict(summary.peak_depth),
        violations=summary.violations,
        left_campus=left,
        by_line=dict(summary.by_line) if in_force is not None else None,
        by_class=dict(summary.by_class) if in_force is not None else None,
        in_force=beside,
        moved=[Moved(**m._asdict()) for m in moves[:MOVES_KEPT]] if in_force is not None else None,
    )


DEFAULT_DROP_POINTS = 2.0  # the margin a verdict judges with when the gate sets none


def thresholds_of(policy: Policy) -> Thresholds:
    """The thresholds of the policy in force's ``[rollout]``, or the defaults (attainment
    0.95, 64 jobs at any node's peak) when it has none; the margin against the policy in
    force is the gate's ``max_drop_points``, or 2 points."""
    gate = policy.rollout
    if gate is None:
        return Thresholds(max_drop_points=DEFAULT_DROP_POINTS)
    drop = gate.max_drop_points if gate.max_drop_points is not None else DEFAULT_DROP_POINTS
    return Thresholds(
        min_attainment=gate.min_attainment,
        max_queue_depth=gate.max_queue_depth,
        max_drop_points=drop,
    )


def candidate_of(policy: Policy | None, params: PlacementParams | None) -> Candidate:
    if policy is not None:
        return Candidate(kind="policy", digest=policy.digest.hex(), version=policy.version)
    if params is not None:
        return Candidate(kind="params", digest=params.digest())
    raise ValueError("a verdict judges a candidate policy or candidate placement parameters")


def verdict_for(
    candidate: Candidate,
    figures: Figures,
    thresholds: Thresholds,
    *,
    trace_sha256: str,
    key: SigningKey,
    key_id: str,
    issued_at: float,
    conditions: dict[str, str] | None = None,
    burst: float = 1.0,
) -> Verdict:
    passed, reasons = judge(figures, thresholds)
    body = Body(
        candidate=candidate,
        trace_sha256=trace_sha256,
        thresholds=thresholds,
        figures=figures,
        passed=passed,
        reasons=reasons,
        issued_at=issued_at,
        conditions=conditions or {},
        burst=burst if burst != 1 else None,
    )
    return sign_verdict(body, key, key_id)


def conditions_of(change: Change) -> dict[str, str]:
    """What a rehearsal assumed besides its candidate, for the verdict to say."""
    out: dict[str, str] = {}
    if change.burst != 1:
        out["burst"] = f"{change.burst}x the recorded arrivals"
    if change.fail:
        out["lost"] = ", ".join(f"{w} at {at:g} s" for w, at in change.fail)
    if change.remove:
        out["removed"] = ", ".join(change.remove)
    if change.degrade:
        out["slowed"] = ", ".join(f"{w} x{f:g}" for w, f in change.degrade)
    if change.add:
        out["added"] = ", ".join(w.id for w in change.add)
    if change.peers:
        out["sister campuses"] = ", ".join(
            f"{p.campus} ({len(p.workers)} workers, {p.rtt_s * 1000:g} ms round trip, "
            f"{p.bytes_per_s / 1e6:g} MB/s)"
            for p in change.peers
        )
    if change.cuts:
        out["links cut"] = ", ".join(f"{c} at {at:g} s for {d:g} s" for c, at, d in change.cuts)
    return out


def write_verdict(path: Path, verdict: Verdict) -> None:
    path.write_bytes(verdict.to_bytes() + b"\n")
