"""A trace from the broker's audit log: decisions unpacked from their records, one job per
job id at its first decision, the edges the header does not list left out, and a log with
nothing to make a trace of refused in words."""

from __future__ import annotations

import json

import pytest

from policies.audit import AuditRecord, Scalar
from sluicegate.app.twin_demo import demo_trace
from sluicegate.twin.audit import AuditTraceError, decisions_of, trace_from_audit
from sluicegate.twin.trace import Trace

HEADER = demo_trace(1.0).header
REFUSED: dict[str, object] = {"status": "refused", "worker": None, "code": "no_faster_worker"}
AGAIN: dict[str, object] = {"worker": "cloud-cpu-1", "attempt": 2}


def _decision(job: str, at: float, **kw: object) -> dict[str, object]:
    return {
        "job_id": job,
        "status": "placed",
        "edge": "line-1-pc",
        "origin_zone": "campus/fab-north/line-1",
        "data_class": "part-image",
        "model": "surface-det",
        "worker": "north-cpu-1",
        "code": None,
        "submitted_at": at,
        "deadline_at": at + 0.2,
        "priority": 5,
        "bytes": 50_000,
        "sha256": None,
        "attempt": 1,
        **kw,
    }


def _record(seq: int, decisions: list[dict[str, object]], kind: str = "placements") -> AuditRecord:
    data: dict[str, Scalar] = {"count": len(decisions), "decisions": json.dumps(decisions)}
    return AuditRecord(seq, 0, kind, data, b"", b"")


def _trace(records: list[AuditRecord]) -> Trace:
    return trace_from_audit(
        records,
        policy=HEADER.policy,
        edges=list(HEADER.edges),
        workers=list(HEADER.workers),
        telemetry_interval_s=1.0,
    )


def test_each_offered_job_is_an_arrival_with_its_first_decision() -> None:
    records = [
        _record(
            0,
            [
                _decision("a", 100.0),
                _decision("b", 100.05, status="refused", worker=None, code="no_faster_worker"),
            ],
        ),
        _record(1, [{"node": "x"}], kind="identity.refused"),
        _record(
            2,
            [
                _decision("a", 100.0, worker="cloud-cpu-1", attempt=2),
                _decision("c", 100.1, edge="stranger"),
            ],
        ),
    ]
    assert len(decisions_of(records)) == 4
    trace = _trace(records)
    jobs = {j.job_id: j for j in trace.jobs}
    assert sorted(jobs) == ["a", "b"]  # "c" comes from an edge the header does not list
    assert jobs["a"].at == 0.0
    assert jobs["a"].worker == "north-cpu-1"  # its first decision
    assert jobs["a"].deadline_ms == pytest.approx(200.0)
    assert jobs["b"].at == pytest.approx(0.05)
    assert not jobs["b"].offloaded
    assert jobs["b"].code == "no_faster_worker"
    assert trace.header.source == "audit"


def test_a_log_without_what_the_jobs_were_is_refused_in_words() -> None:
    old = _decision("a", 100.0)
    del old["submitted_at"]
    with pytest.raises(AuditTraceError, match="no placement decision"):
        _trace([_record(0, [old])])
    broken = AuditRecord(3, 0, "placements", {"decisions": "[not json"}, b"", b"")
    with pytest.raises(AuditTraceError, match="audit record 3"):
        _trace([broken])
