"""Every placement decision into the signed, hash-chained audit log, without slowing them.

Decisions are added as they are answered; a background task writes whatever accumulated
while the previous record was being signed and stored, packed into as few records
(``placements``) as the log's record size allows, so the cost of a signature and a Redis
round trip is shared by a burst. Each decision keeps its top candidates and the reasons the
others were filtered out. What becomes of placed jobs afterwards (a worker lost with them,
a dead letter, a stale completion: ``broker.reaper``) goes through the same queue under a
kind of its own, so the chain has one writer. A write that fails (Redis away) is retried,
oldest first; nothing is dropped unless the backlog passes ``max_backlog``, and then loudly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from broker.core.decision import Decision, as_record
from broker.lua import check_cancelled
from policies import AsyncAuditWriter
from policies.audit import MAX_RECORD_BYTES, Scalar
from policies.errors import AuditError, StoreUnavailable
from sluicegate.wire_pool import PlacementReply, PlacementRequest

log = logging.getLogger(__name__)

# Room left in a record for its envelope (sequence, hashes, signature, kind, job list).
BUDGET = MAX_RECORD_BYTES // 2  # JSON-escaping the decisions can at most double them
RETRY_S = 0.5
PLACEMENTS = "placements"


def decision_record(
    req: PlacementRequest, reply: PlacementReply, decision: Decision | None
) -> dict[str, Any]:
    """What the log (and the job's record) keeps of one answered request: who asked, what
    the job was (a twin trace can be derived from it: ``sluicegate.twin.audit``), the
    answer, and the decision's why."""
    record: dict[str, Any] = {
        "job_id": req.job_id,
        "status": reply.status,
        "edge": req.edge_id,
        "origin_zone": req.origin_zone,
        "data_class": req.data_class,
        "model": req.model,
        "worker": reply.worker_id,
        "code": reply.code,
        "reason": reply.reason,
        "submitted_at": req.submitted_at,
        "deadline_at": req.deadline_at,
        "priority": req.priority,
        "bytes": req.payload_bytes,
        "sha256": req.model_sha256,
        "attempt": req.attempt,
    }
    if reply.campus is not None:  # placed on a sister campus, by its broker
        record["campus"] = reply.campus
    if decision is not None:
        record["why"] = as_record(decision)
    return record


def encode(decision: dict[str, Any]) -> str:
    """One decision as compact JSON, its explanation cut if it alone would not fit."""
    text = json.dumps(decision, default=str, separators=(",", ":"))
    if len(text) > BUDGET // 2:
        slim = {**decision, "why": "(explanation too long for the audit record; see the job)"}
        text = json.dumps(slim, default=str, separators=(",", ":"))
    return text


def pack(decisions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Group ``(job_id, json)`` pairs into records that each stay within the budget."""
    records: list[list[tuple[str, str]]] = []
    size = BUDGET
    for job_id, text in decisions:
        cost = len(text) + len(job_id) + 2
        if size + cost > BUDGET:
            records.append([])
            size = 0
        records[-1].append((job_id, text))
        size += cost
    return records


class DecisionAudit:
    def __init__(
        self, writer: AsyncAuditWriter, clock: Callable[[], float], max_backlog: int = 100_000
    ) -> None:
        self._writer = writer
        self._clock = clock
        self._max_backlog = max_backlog
        self._pending: deque[tuple[str, str, str]] = deque()  # (kind, job id, json)
        self._wanted = asyncio.Event()
        self.written = 0  # decisions stored so far
        self.dropped = 0  # decisions lost because the backlog overflowed

    def add(self, job_id: str, text: str, kind: str = PLACEMENTS) -> None:
        """Queue one decision (or, with ``kind``, another event about a job), already
        encoded by :func:`encode`."""
        self._pending.append((kind, job_id, text))
        if len(self._pending) > self._max_backlog:
            self._pending.popleft()
            self.dropped += 1
            log.error("audit backlog over %d decisions: the oldest was dropped", self._max_backlog)
        self._wanted.set()

    @property
    def backlog(self) -> int:
        return len(self._pending)

    async def run(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            while self._pending:
                kind = self._pending[0][0]
                batch = []
                for item_kind, job_id, text in self._pending:
                    if item_kind != kind:
                        break
                    batch.append((job_id, text))
                for record in pack(batch):
                    data: dict[str, Scalar] = {
                        "count": len(record),
                        "jobs": ",".join(job_id for job_id, _ in record),
                        "decisions": "[" + ",".join(text for _, text in record) + "]",
                    }
                    try:
                        await self._writer.append(kind, data, now=self._clock())
                    except (StoreUnavailable, AuditError) as exc:
                        log.warning("audit append failed (%s); retrying in %.1f s", exc, RETRY_S)
                        await asyncio.sleep(RETRY_S)
                        break
                    finally:
                        check_cancelled()  # the store may be redis-py (see broker.lua)
                    for _ in record:
                        self._pending.popleft()
                    self.written += len(record)
