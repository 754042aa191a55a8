"""The loop side of a worker's intake: each work message from the transport to the batch
queue, or to a refusal, before anything looks at its image.

The transport's callback only queues a message with the time it arrived
(:meth:`Intake.take`). The intake loop takes them off a chunk at a time, waits for room in the
audit log, and has the :class:`~center_pool.gate.Gate` screen the chunk: the placement token
(signature, zone, payload hash), its nonce against replay, and a sealed image's opening. A
job that passed is admitted (:func:`~center_pool.intake.admit_work`: model, deadline,
priority, image header) onto the :class:`~center_pool.batching.BatchQueue`, or refused when
the queue is full. A refusal is counted, logged, audited where the gate says so, and answered
through the :class:`~center_pool.replies.Replies`. It never decodes an image, and a fault in
screening one chunk never stops it serving the next.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable, Mapping

from center_pool.batching import BatchQueue, Entry, start_by
from center_pool.gate import Gate, Passed, Stopped, audit_data
from center_pool.guard import REFUSED, AuditSink, check_cancelled
from center_pool.intake import Work, WorkItem, WorkRefusal, admit_work, refuse
from center_pool.replies import Replies
from center_pool.reporting import ServiceStats
from policies import PlacementClaims
from sluicegate.config import PoolSettings
from sluicegate.transport import Message
from sluicegate.vision.image import PayloadLimits as Limits

log = logging.getLogger(__name__)

INTAKE_CHUNK = 256  # work messages screened per pass of the intake loop


class Intake:
    """One worker's work messages, screened in arrival order by one loop (:meth:`run`)."""

    def __init__(
        self,
        settings: PoolSettings,
        gate: Gate,
        queue: BatchQueue[WorkItem],
        replies: Replies,
        audit: AuditSink,
        service: ServiceStats,
        *,
        limits: Limits,
        clock: Callable[[], float],
        accepting: Callable[[], bool],
        dispatch: Callable[[], None],
    ) -> None:
        """``accepting``: whether the worker takes new work now (else each job is refused as
        shutting down). ``dispatch``: run after each chunk, to start what became ready."""
        self._settings = settings
        self._gate = gate
        self._queue = queue
        self._replies = replies
        self._audit = audit
        self._service = service
        self._limits = limits
        self._clock = clock
        self._accepting = accepting
        self._dispatch = dispatch
        self.models: Mapping[str, str] = {}  # the models served, name to sha256
        self.refused: Counter[str] = Counter()
        self._waiting: deque[tuple[Message, float]] = deque()
        self._wake = asyncio.Event()
        self._screening = 0  # messages taken off the intake, not yet admitted or refused

    @property
    def waiting(self) -> int:
        """Messages queued, not yet taken off to be screened."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether any message is queued or being screened."""
        return bool(self._waiting or self._screening)

    def take(self, msg: Message) -> None:
        """Queue ``msg``, stamped with the time it arrived, for the loop."""
        self._waiting.append((msg, self._clock()))
        self.wake()

    def wake(self) -> None:
        """Have the loop look at the queue (at shutdown: refuse what is left)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                await self._audit.room()
                size = min(len(self._waiting), INTAKE_CHUNK)
                chunk = [self._waiting.popleft() for _ in range(size)]
                self._screening += len(chunk)
                verdicts: list[Passed | Stopped] = []
                try:
                    verdicts = await self._gate.screen(chunk, accepting=self._accepting())
                except Exception:  # a fault in screening leaves the loop serving the rest
                    log.exception("intake failed for %d work message(s)", len(chunk))
                finally:
                    self._screening -= len(chunk)
                check_cancelled()  # the replay cache may be redis-py, which can lose it
                for verdict in verdicts:
                    if isinstance(verdict, Passed):
                        self._admit(verdict.work, verdict.claims)
                    else:
                        self._refuse(verdict)
                self._dispatch()

    def _admit(self, work: Work, claims: PlacementClaims) -> None:
        now = self._clock()
        item = admit_work(work, claims, models=self.models, limits=self._limits, now=now)
        if isinstance(item, WorkRefusal):
            self._refuse(Stopped(item, work, audit=False))
            return
        start = start_by(item.deadline, now, self._service.batch_estimate_s(item.model))
        if not self._queue.push(Entry(item, item.model, now, item.priority, start)):
            reason = (
                f"worker {self._settings.id} has {self._settings.queue_size} jobs queued; "
                "ask the broker for another placement"
            )
            refusal = refuse(work, "queue_full", reason, token_passed=True)
            self._refuse(Stopped(refusal, work, audit=False))

    def _refuse(self, stopped: Stopped) -> None:
        refusal = stopped.refusal
        self.refused[refusal.code] += 1
        log.info("refused job %s [%s]: %s", refusal.job_id, refusal.code, refusal.reason)
        if stopped.audit:
            data = audit_data(stopped, self._settings.id)
            self._audit.submit(REFUSED, data, now=self._clock())
        self._replies.refusal(refusal)
