"""The answers to requests that do not become a job's result: a repeat of an id the edge
knows (what it gets is ``rules.repeat_plan``'s choice, carried out here) and a request
refused after it was read as a job (its refusal published, and its record in the twin's
trace). Shared by the dispatcher (a repeat it spots in memory, a refusal at intake) and the
carrier (a repeat the acceptance commit finds on disk, a store that failed).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from edge_agent import rules
from edge_agent.admission import Job, RequestRefusal, forgotten, outbox_unavailable
from edge_agent.answers import Answers
from edge_agent.errors import OutboxError
from edge_agent.jobs import JobTable
from edge_agent.outbox import Stored
from edge_agent.tally import Tally
from edge_agent.trace_log import TraceLog, refusal_of
from sluicegate.transport import Message, Transport

log = logging.getLogger(__name__)


class Replies:
    """Repeats answered and refusals sent for one edge agent (loop thread only)."""

    def __init__(
        self,
        *,
        edge_id: str,
        answers: Answers,
        transport: Transport,
        table: JobTable,
        counters: Counter[str],
        trace: TraceLog | None,
        result_retention_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._edge_id = edge_id
        self._answers = answers
        self._transport = transport
        self._table = table
        self._counters = counters
        self._trace = trace
        self._retention_s = result_retention_s
        self._clock = clock

    def repeat(
        self, job: Job, stored: Stored | None, msg: Message, plan: rules.Repeat | None = None
    ) -> None:
        """A request for an id the outbox holds as ``stored`` (None: only its tombstone),
        answered as ``plan`` says (by default ``rules.repeat_plan``'s for the row; "track"
        is the dispatcher's to carry out)."""
        if plan is None:
            plan = rules.repeat_plan(stored.state if stored else None, dup=msg.dup)
        if plan == "redelivered":
            self._counters[Tally.REDELIVERED] += 1
            self._transport.ack(msg)
            return
        self._counters[Tally.DUPLICATES] += 1
        if plan == "forgotten":
            self._answers.refuse(forgotten(job, self._retention_s), msg)
            return
        assert stored is not None
        current = self._table.get(job.job_id)
        if plan == "retarget" and current is not None:
            current.job = stored.job  # the result goes where the latest request asked
        elif plan == "republish" and stored.result is not None:
            log.info("job %s was resubmitted; answering with its stored result", job.job_id)
            self._answers.publish(job, stored.result, record=False)
        self._transport.ack(msg)

    def store_failed(self, job: Job, msg: Message, exc: OutboxError) -> None:
        self._counters[Tally.OUTBOX_ERRORS] += 1
        log.error("could not store job %s: %s", job.job_id, exc)
        self.refuse(job, outbox_unavailable(job, self._edge_id, exc), msg)

    def refuse(self, job: Job, refusal: RequestRefusal, msg: Message) -> None:
        """Refuse a request that was read as a job; its record goes into the trace."""
        self._answers.refuse(refusal, msg)
        trace = self._trace
        if trace is not None and refusal.response_topic is not None:
            record = refusal_of(job, refusal.status, refusal.code, now=self._clock())
            if not trace.add(record):
                self._counters[Tally.TRACE_DROPPED] += 1
