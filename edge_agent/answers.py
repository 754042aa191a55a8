"""Everything the edge agent tells apps, in the order that makes "exactly one result" hold.

A refusal (a request that was not accepted) is never stored: it is published, and the
request is acked only once the MQTT broker has the refusal (a crash before that leaves the
request unacked, so it is delivered again and refused again). The result of an accepted
job is committed to the outbox first (the dispatcher asks for that and hears how it went),
then published QoS 1 to the job's response topic with its correlation data, then marked
delivered once the broker's PUBACK is back. A crash anywhere in that sequence leaves the job
pending (it runs, or is awaited, again) or done but undelivered (published again after the
restart). A publish the broker *refuses* (a PUBACK with a failure reason code: the ACL does
not let this edge write the job's response topic) would be refused every time: the job
ends there, its result kept on disk marked undeliverable with the broker's reason, logged
as an error and counted (``results_refused``), never published again; a refused refusal
acks its request, which could never be answered either.

A worker's return for an attempt already recorded on disk may be *forwarded*: published
first, committed meanwhile; its message is acked only once the commit lands, so a crash in
between leaves the job awaiting that same attempt and the return unacked, and the same bytes
go out again. So the only raw duplicate an app can see is the same result published again
because the agent died before recording it; results carry ``job_id``, and the Python client
drops them. Publishing waits in tasks of its own, never on the loop's path.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from edge_agent.admission import Job, RequestRefusal
from edge_agent.errors import OutboxError
from edge_agent.outbox import Outbox
from edge_agent.rules import Declined
from sluicegate import wire
from sluicegate.errors import PublishRefused, TransportError
from sluicegate.transport import Message, Transport
from sluicegate.vision.postprocess import Outputs as VisionOutputs
from sluicegate.vision.runtime import StageTimes

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    placed_on: str | None = None,
) -> wire.JobResult:
    """The result document of a job concluded on this edge (``declined``: why it did not
    leave, or came back from ``placed_on``, with its time waiting for placements and on
    workers when the lifecycle stamped it)."""
    queue_ms = ((started or now) - job.received_at) * 1000.0
    asked_ms = declined.asked_ms if declined is not None else None
    away_ms = declined.away_ms if declined is not None and placed_on is not None else None
    timings = wire.Timings(
        queue_ms=round(queue_ms, 3),
        decode_ms=round(times.decode_ms, 3) if times else 0.0,
        preprocess_ms=round(times.preprocess_ms, 3) if times else 0.0,
        inference_ms=round(times.inference_ms, 3) if times else 0.0,
        total_ms=round((now - job.received_at) * 1000.0, 3),
        device_ms=round(times.decode_ms + times.preprocess_ms + times.inference_ms, 3)
        if times
        else 0.0,
        placement_ms=asked_ms,
        offloaded_ms=away_ms,
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
        offload=declined.as_wire(placed_on) if declined is not None else None,
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    """How an answer's publish went: acked, lost (no ack: sent again after a restart), or
    refused by the broker (``refused``: its reason code), which would refuse it again."""

    acked: bool
    refused: str | None = None

    @property
    def final(self) -> bool:
        """The broker answered: this publish is over, for good or ill."""
        return self.acked or self.refused is not None


ACKED, LOST = Outcome(acked=True), Outcome(acked=False)


class Answers:
    """Refusals, results and republished results of one edge agent."""

    def __init__(self, transport: Transport, outbox: Outbox, ran_on: wire.RanOn) -> None:
        self._transport = transport
        self._outbox = outbox
        self._ran_on = ran_on
        self.results: Counter[str] = Counter()  # by status: refusals and concluded jobs
        self.finished: Counter[str] = Counter()  # ok results by where they ran: edge, pool
        self.dropped_no_response_topic = 0
        self.undelivered = 0  # publishes the broker never acked (published again on restart)
        self.refused = 0  # answers the broker refused (each logged; results kept on disk)
        self._tasks: set[asyncio.Task[Any]] = set()

    def refuse(self, refusal: RequestRefusal, msg: Message | None = None) -> None:
        """Answer a request that was not accepted; ack it once the answer is out."""
        if refusal.response_topic is None:
            self.dropped_no_response_topic += 1
            log.warning(
                "dropped job %s: %s (nowhere to send a result)", refusal.job_id, refusal.reason
            )
            if msg is not None:
                self._transport.ack(msg)
            return
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
        self._track(self._refuse(refusal, wire.dump(result), msg))

    async def _refuse(self, refusal: RequestRefusal, payload: bytes, msg: Message | None) -> None:
        assert refusal.response_topic is not None
        topic, corr = refusal.response_topic, refusal.correlation_data
        if not (await self._out(topic, corr, payload, refusal.job_id, "refusal")).final:
            return  # unacked: the request comes again, and is refused again
        if msg is not None:
            self._transport.ack(msg)

    async def _out(
        self, topic: str, corr: bytes | None, payload: bytes, job_id: str, what: str
    ) -> Outcome:
        """Publish an answer QoS 1: acked, refused by the broker (for good), or lost."""
        try:
            await self._transport.publish(
                Message(
                    topic,
                    payload,
                    qos=1,
                    correlation_data=corr,
                    content_type=wire.RESULT_CONTENT_TYPE,
                ),
                wait=True,
            )
        except PublishRefused as exc:
            self.refused += 1
            log.error(
                "the broker refused the %s of job %s on %r (%s): this edge may not publish "
                "there (the ACL); it is not sent again. The app should use a response topic "
                "under its [apps] results prefixes",
                what,
                job_id,
                topic,
                exc.reason,
            )
            return Outcome(acked=False, refused=exc.reason)
        except TransportError as exc:
            log.warning("the %s of job %s was not acked by the broker: %s", what, job_id, exc)
            return LOST
        return ACKED

    def forward(self, job: Job, payload: bytes) -> asyncio.Task[Outcome]:
        """Publish a worker's result before its commit; the task says how that went."""
        return self._track(self._send(job, payload))

    def publish(
        self, job: Job, payload: bytes, *, record: bool, sent: asyncio.Task[Outcome] | None = None
    ) -> None:
        """Publish a committed result to the job's (latest) destination, in a task (or, with
        ``sent``, wait for the forward already publishing it); with ``record``, mark it
        delivered once the broker acked it."""
        self._track(self._deliver(job, payload, record=record, sent=sent))

    async def _deliver(
        self, job: Job, payload: bytes, *, record: bool, sent: asyncio.Task[Outcome] | None
    ) -> None:
        outcome = await sent if sent is not None else await self._send(job, payload)
        if not (outcome.final and record):
            return
        try:
            await self._outbox.delivered(job.job_id, undeliverable=outcome.refused)
        except OutboxError as exc:
            log.warning("could not record the delivery of job %s: %s", job.job_id, exc)

    async def _send(self, job: Job, payload: bytes) -> Outcome:
        """Publish a result QoS 1 (if lost, it stays undelivered on disk, and is published
        again after a restart)."""
        outcome = await self._out(
            job.response_topic, job.correlation_data, payload, job.job_id, "result"
        )
        self.undelivered += not outcome.final
        return outcome

    @property
    def delivering(self) -> int:
        return len(self._tasks)  # a task leaves the set as it finishes

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
