"""Everything the edge agent tells apps, in the order that makes "exactly one result" hold.

A refusal (a request that was not accepted) is published at once and never stored. The
result of an accepted job is committed to the outbox first, then published QoS 1 to the
job's response topic with its correlation data, then marked delivered once the broker's
PUBACK is back. A crash anywhere in that sequence leaves the job pending (it runs, or is
awaited, again) or done but undelivered (published again after the restart).

A worker's return for an attempt already recorded on disk is *forwarded*: published first,
committed meanwhile. Its message is acked only once the commit lands, so a crash in between
leaves the job awaiting that same attempt and the return unacked; the broker redelivers it
and the same bytes go out again. So, either way, the only raw duplicate an app can see is
the same result published again because the agent died before recording it; results carry
``job_id``, and the Python client drops them. Publishing waits in tasks of its own, never on
the loop's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from edge_agent.admission import Job, Refusal
from edge_agent.errors import OutboxError
from edge_agent.offload import Declined
from edge_agent.outbox import Outbox
from sluicegate import wire
from sluicegate.transport import Message, Transport
from sluicegate.vision.postprocess import Outputs as VisionOutputs
from sluicegate.vision.runtime import StageTimes

log = logging.getLogger(__name__)
T = TypeVar("T")

Committed = Callable[[bool | None], None]  # True: stored; False: concluded already; None: error


def local_result(
    job: Job,
    status: wire.Status,
    *,
    ran_on: wire.RanOn,
    now: float,
    code: str | None = None,
    reason: str | None = None,
    outputs: VisionOutputs | None = None,
    times: StageTimes | None = None,
    started: float | None = None,
    declined: Declined | None = None,
) -> wire.JobResult:
    """The result document of a job concluded on this edge."""
    queue_ms = ((started or now) - job.received_at) * 1000.0
    timings = wire.Timings(
        queue_ms=round(queue_ms, 3),
        decode_ms=round(times.decode_ms, 3) if times else 0.0,
        preprocess_ms=round(times.preprocess_ms, 3) if times else 0.0,
        inference_ms=round(times.inference_ms, 3) if times else 0.0,
        total_ms=round((now - job.received_at) * 1000.0, 3),
    )
    return wire.JobResult(
        job_id=job.job_id,
        status=status,
        code=code,
        reason=reason,
        model=job.model,
        outputs=wire.outputs_of(outputs) if outputs is not None else None,
        ran_on=ran_on,
        timings_ms=timings,
        offload=declined.as_wire() if declined is not None else None,
    )


@dataclass(frozen=True, slots=True)
class _Ending:
    """A result on its way to the disk: whose, its status, who hears how the commit went,
    and the message to ack once it landed."""

    job: Job
    status: str
    then: Committed
    ack: Message | None


class Answers:
    """Refusals, results and republished results of one edge agent."""

    def __init__(self, transport: Transport, outbox: Outbox, ran_on: wire.RanOn) -> None:
        self._transport = transport
        self._outbox = outbox
        self._ran_on = ran_on
        self.results: Counter[str] = Counter()  # by status: refusals and concluded jobs
        self.dropped_no_response_topic = 0
        self.undelivered = 0  # publishes the broker never acked (published again on restart)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._killed = False

    def refuse(self, refusal: Refusal, msg: Message | None = None) -> None:
        """Answer a request that was not accepted, then ack it."""
        if refusal.response_topic is None:
            self.dropped_no_response_topic += 1
            log.warning(
                "dropped job %s: %s (nowhere to send a result)", refusal.job_id, refusal.reason
            )
        else:
            log.info("refused job %s: %s", refusal.job_id, refusal.reason)
            result = wire.JobResult(
                job_id=refusal.job_id,
                status=refusal.status,
                code=refusal.code,
                reason=refusal.reason,
                model=refusal.model,
                ran_on=self._ran_on,
            )
            self.results[result.status] += 1
            try:
                self._transport.publish_nowait(
                    refusal.response_topic,
                    wire.dump(result),
                    qos=1,
                    correlation_data=refusal.correlation_data,
                    content_type=wire.RESULT_CONTENT_TYPE,
                )
            except Exception as exc:  # logged, never silent; the request is acked regardless
                log.error("could not publish the refusal of job %s: %s", refusal.job_id, exc)
        if msg is not None:
            self._transport.ack(msg)

    def conclude(
        self,
        job: Job,
        payload: bytes,
        status: str,
        then: Committed,
        *,
        attempt: int | None = None,
        ack: Message | None = None,
        forward: bool = False,
    ) -> None:
        """Commit ``payload`` as the job's result (only the first one counts; with
        ``attempt``, only while the job is offloaded as that attempt), ack ``ack`` once it
        is committed, publish it, and tell ``then`` how the commit went. With ``forward``
        (a return whose attempt is on disk), publish it first and commit meanwhile."""
        fut = self._outbox.finish(job.job_id, payload, attempt=attempt)
        ending = _Ending(job, status, then, ack)
        if forward:
            sent = self._track(self._send(job, payload))
            self._track(self._forward(ending, fut, sent))
            return
        fut.add_done_callback(partial(self._committed, ending, payload))

    async def _forward(
        self, ending: _Ending, fut: asyncio.Future[bool], sent: asyncio.Task[bool]
    ) -> None:
        with contextlib.suppress(OutboxError):  # reported by _settle
            await fut
        if self._killed:
            return
        stored = self._settle(ending, fut, publish=None)
        if await sent and stored:
            await self._record_delivery(ending.job)

    def _committed(self, ending: _Ending, payload: bytes, fut: asyncio.Future[bool]) -> None:
        if not self._killed:
            self._settle(ending, fut, publish=payload)

    def _settle(
        self, ending: _Ending, fut: asyncio.Future[bool], *, publish: bytes | None
    ) -> bool | None:
        """Act on a finished commit: ack the request unless it failed, count a stored
        result and publish ``publish`` (None: forwarded already), tell the caller; return
        the outcome."""
        job, status = ending.job, ending.status
        try:
            stored: bool | None = fut.result()
        except OutboxError as exc:  # not committed: it replays (or is redelivered) later
            log.error("could not store the result of job %s: %s", job.job_id, exc)
            stored = None
        if stored is not None and ending.ack is not None:
            self._transport.ack(ending.ack)
        if stored:
            self.results[status] += 1
            if publish is not None:
                self.publish(job, publish, record=True)
        elif stored is False and publish is None:  # the disk moved on under this agent
            log.warning("job %s: a forwarded result was not the one on disk", job.job_id)
        elif stored is False:
            log.info("job %s was already concluded; this %s result is dropped", job.job_id, status)
        ending.then(stored)
        return stored

    def publish(self, job: Job, payload: bytes, *, record: bool) -> None:
        """Publish a committed result to the job's (latest) destination, in a task; with
        ``record``, mark it delivered once the broker acked it."""
        self.spawn(self._deliver(job, payload, record=record))

    async def _deliver(self, job: Job, payload: bytes, *, record: bool) -> None:
        if await self._send(job, payload) and record:
            await self._record_delivery(job)

    async def _send(self, job: Job, payload: bytes) -> bool:
        """Publish a result QoS 1; True once the broker acked it."""
        try:
            await self._transport.publish(
                job.response_topic,
                payload,
                qos=1,
                correlation_data=job.correlation_data,
                content_type=wire.RESULT_CONTENT_TYPE,
                wait=True,
            )
        except Exception as exc:  # stays undelivered on disk: published again after a restart
            self.undelivered += 1
            log.warning("result of job %s not acked by the broker: %s", job.job_id, exc)
            return False
        return True

    async def _record_delivery(self, job: Job) -> None:
        try:
            await self._outbox.delivered(job.job_id)
        except OutboxError as exc:
            log.warning("could not record the delivery of job %s: %s", job.job_id, exc)

    @property
    def delivering(self) -> int:
        return len(self._tasks)  # a task leaves the set as it finishes

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._track(coro)

    def _track(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for the publishes in progress, then cancel the rest."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        self.cancel()

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def kill(self) -> None:
        self._killed = True
        self.cancel()
