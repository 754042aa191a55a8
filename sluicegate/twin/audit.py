"""A trace derived from the broker's signed audit log and the fleet's documents, where no
recording ran: what the broker saw.

Every placement decision is in the broker's hash-chained audit log (``placements`` records,
each packing the decisions answered together), with what the job was: its edge and origin,
model and file, data class, priority, deadline, size and when it was submitted. Those are
the arrivals of this trace, one per job (its first attempt's), and the decision is its
recorded outcome as far as the log knows it (placed on which worker, or refused with which
code). The header is built as a recording builds it, from the nodes' latest capabilities
and telemetry (the broker keeps them in its store) and the policy in force.

What the log does not hold, this trace does not either: jobs an edge ran without asking
the broker (its own deadline met) never reach it, so the replay sees only the offered part
of the load, and measured times (service, transfer, batches) are absent, so the replay
draws on the nodes' reported service times and the parameters' links, as for a synthetic
trace. Pure: records and documents come in, a :class:`~sluicegate.twin.trace.Trace` goes
out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from policies.audit import AuditRecord
from sluicegate.twin import trace as tr

PLACEMENTS = "placements"  # broker.decision_audit's record kind for decisions


class AuditTraceError(tr.TraceError):
    """The audit log holds no decision a trace can be made of, or one that is unreadable."""


def decisions_of(records: Iterable[AuditRecord]) -> list[dict[str, Any]]:
    """Every decision packed in the log's ``placements`` records, in the log's order."""
    out: list[dict[str, Any]] = []
    for record in records:
        if record.kind != PLACEMENTS:
            continue
        try:
            packed = json.loads(str(record.data["decisions"]))
        except (KeyError, ValueError) as exc:
            raise AuditTraceError(
                f"audit record {record.seq}: its decisions cannot be read"
            ) from exc
        out.extend(d for d in packed if isinstance(d, dict))
    return out


def _job(d: Mapping[str, Any], t0: float) -> tr.JobRecord:
    deadline = d.get("deadline_at")
    placed = d.get("status") == "placed"
    return tr.JobRecord(
        at=max(0.0, float(d["submitted_at"]) - t0),
        edge=str(d["edge"]),
        job_id=str(d["job_id"]),
        model=str(d["model"]),
        sha256=d.get("sha256"),
        data_class=str(d["data_class"]),
        priority=int(d.get("priority", 5)),
        deadline_ms=(float(deadline) - float(d["submitted_at"])) * 1000.0 if deadline else None,
        bytes=int(d.get("bytes", 0)),
        offloaded=placed,
        worker=d.get("worker") if placed else None,
        code=None if placed else d.get("code"),
    )


def trace_from_audit(
    records: Iterable[AuditRecord],
    *,
    policy: str,
    edges: list[tr.EdgeSpec],
    workers: list[tr.WorkerSpec],
    telemetry_interval_s: float,
    params: Mapping[str, object] | None = None,
) -> tr.Trace:
    """The trace of the decisions in ``records`` (see the module docstring): one job per
    job id, at its first decision; jobs from edges ``edges`` does not list are left out."""
    known = {e.id for e in edges}
    first: dict[str, Mapping[str, Any]] = {}
    for d in decisions_of(records):
        if "submitted_at" not in d:
            continue  # a decision logged before the log held what the job was
        first.setdefault(str(d.get("job_id")), d)
    offers = [d for d in first.values() if d.get("edge") in known]
    if not offers:
        raise AuditTraceError(
            "the audit log holds no placement decision of a listed edge with what the job "
            "was (decisions are logged with it from this version of the broker on)"
        )
    t0 = min(float(d["submitted_at"]) for d in offers)
    try:
        jobs = sorted((_job(d, t0) for d in offers), key=lambda j: (j.at, j.job_id))
    except (KeyError, TypeError, ValueError) as exc:
        raise AuditTraceError(f"a decision in the audit log cannot be read: {exc}") from exc
    header = tr.Header(
        started_at=t0,
        source="audit",
        policy=tr.policy_field(policy, source="the broker's policy file"),
        params=dict(params or {}),
        telemetry_interval_s=telemetry_interval_s,
        edges=edges,
        workers=workers,
    )
    return tr.Trace(header, tuple(jobs))
