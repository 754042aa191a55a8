"""What the vision app submitted and what came back, judged against "exactly one result".

A :class:`Ledger` keeps, per job id, when the job was published, when Mosquitto PUBACKed it
(from then on it counts as accepted by the campus: the broker holds it for the edge), every
raw delivery of a result for it, and how often the app resubmitted it. :meth:`Ledger.verdict`
turns that into the Jepsen-queue figures: lost (accepted, no result), duplicated (more than
one *distinct* result: the campus committed two answers for one job), raw duplicates (the
same result delivered again, which an app removes by job id), unexpected (results for ids
never submitted). Pure bookkeeping: no I/O, the caller passes the clock's readings.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class JobRecord:
    job_id: str
    edge: str
    published_at: float
    accepted_at: float | None = None
    last_published_at: float = 0.0
    resubmits: int = 0
    deliveries: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    @property
    def first_result_at(self) -> float | None:
        return self.deliveries[0][0] if self.deliveries else None

    def distinct_results(self) -> list[dict[str, Any]]:
        distinct: list[dict[str, Any]] = []
        for _at, doc in self.deliveries:
            if doc not in distinct:
                distinct.append(doc)
        return distinct


@dataclass(frozen=True)
class Verdict:
    submitted: int
    accepted: int
    answered: int  # accepted jobs with at least one result
    lost: list[str]  # accepted, no result
    duplicated: dict[str, list[dict[str, Any]]]  # job id -> its distinct results (> 1)
    raw_duplicates: int  # deliveries beyond the first that repeat the same result
    unexpected: int  # results for job ids never submitted
    unaccepted: int  # published but never PUBACKed (not owed a result)
    statuses: Counter[str]
    codes: Counter[str]
    ran_on: Counter[str]
    resubmits: int

    @property
    def ok(self) -> bool:
        return not self.lost and not self.duplicated and self.unexpected == 0

    def explain(self, limit: int = 5) -> str:
        """One paragraph a failing assertion prints."""
        parts = [
            f"accepted {self.accepted}, answered {self.answered}, lost {len(self.lost)}, "
            f"duplicated {len(self.duplicated)}, raw duplicates {self.raw_duplicates}, "
            f"unexpected {self.unexpected}, never acked {self.unaccepted}; "
            f"statuses {dict(self.statuses)}, codes {dict(self.codes)}, ran on {dict(self.ran_on)}"
        ]
        if self.lost:
            parts.append(f"lost e.g. {self.lost[:limit]}")
        for job_id, results in list(self.duplicated.items())[:limit]:
            parts.append(f"{job_id} got {len(results)} different results: {_differences(results)}")
        return "; ".join(parts)


def _differences(results: list[dict[str, Any]]) -> str:
    keys = sorted(
        {k for r in results for k in r if len({json.dumps(x.get(k)) for x in results}) > 1}
    )
    return ", ".join(f"{k}: {[r.get(k) for r in results]}" for k in keys if k != "timings_ms") or (
        "timings only"
    )


class Ledger:
    """Per job id: publication, PUBACK, results. Fed by the app, read by the verdict."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self.unexpected: Counter[str] = Counter()
        self.malformed_results = 0

    def published(self, job_id: str, edge: str, at: float) -> JobRecord:
        record = self.jobs.get(job_id)
        if record is None:
            record = self.jobs[job_id] = JobRecord(job_id, edge, at)
        else:
            record.resubmits += 1
        record.last_published_at = at
        return record

    def acked(self, job_id: str, at: float) -> None:
        record = self.jobs[job_id]
        if record.accepted_at is None:
            record.accepted_at = at

    def delivered(self, payload: bytes, correlation: bytes | None, at: float) -> JobRecord | None:
        """Record one raw result delivery; returns its job's record (None if unknown)."""
        try:
            doc = json.loads(payload)
            job_id = str(doc["job_id"])
        except (ValueError, KeyError, TypeError):
            self.malformed_results += 1
            return None
        record = self.jobs.get(job_id)
        if record is None and correlation is not None:
            record = self.jobs.get(correlation.decode(errors="replace"))
        if record is None:
            self.unexpected[job_id] += 1
            return None
        record.deliveries.append((at, doc))
        return record

    def pending(self) -> list[str]:
        """Accepted jobs with no result yet."""
        return [
            j.job_id for j in self.jobs.values() if j.accepted_at is not None and not j.deliveries
        ]

    def unanswered(self) -> list[JobRecord]:
        """Published jobs (acked or not) with no result yet: what an app would resubmit."""
        return [j for j in self.jobs.values() if not j.deliveries]

    def verdict(self) -> Verdict:
        accepted = [j for j in self.jobs.values() if j.accepted_at is not None]
        statuses: Counter[str] = Counter()
        codes: Counter[str] = Counter()
        ran_on: Counter[str] = Counter()
        duplicated: dict[str, list[dict[str, Any]]] = {}
        raw_duplicates = 0
        for job in self.jobs.values():
            if not job.deliveries:
                continue
            distinct = job.distinct_results()
            raw_duplicates += len(job.deliveries) - len(distinct)
            if len(distinct) > 1:
                duplicated[job.job_id] = distinct
            first = job.deliveries[0][1]
            statuses[str(first.get("status"))] += 1
            if first.get("code"):
                codes[str(first["code"])] += 1
            ran_on[str((first.get("ran_on") or {}).get("node"))] += 1
        return Verdict(
            submitted=len(self.jobs),
            accepted=len(accepted),
            answered=sum(1 for j in accepted if j.deliveries),
            lost=[j.job_id for j in accepted if not j.deliveries],
            duplicated=duplicated,
            raw_duplicates=raw_duplicates,
            unexpected=sum(self.unexpected.values()),
            unaccepted=sum(1 for j in self.jobs.values() if j.accepted_at is None),
            statuses=statuses,
            codes=codes,
            ran_on=ran_on,
            resubmits=sum(j.resubmits for j in self.jobs.values()),
        )
