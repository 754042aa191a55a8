"""Everything a worker says about a job: the result, returned to the edge agent that placed
it (``topics.edge_returns``, under this worker's id, or, for a sister campus's edge,
``topics.peer_returns`` in a ``wire_peer`` envelope; never the app's own topic: the edge
owns each accepted job until it is terminal, drops duplicates and stale attempts, and
answers the app), and the completion record for the broker on
``sluicegate/v1/broker/completions/<worker id>`` (no outputs, no image). A result carries
the work message's correlation data unchanged and the user properties job id, attempt and
worker id, so the edge can fence it without decoding it.

Both go out QoS 1 through ``publish_nowait`` (the client retries until acked). A refusal gets
a completion only when its token had passed: before that, nothing was placed here for the
broker to release. A result with no edge to return to is counted (``unreturned``) and
logged; its refusal was audited by the gate. Publishing never raises into the caller: a
message that cannot be queued is logged with its job id.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from center_pool.intake import WorkRefusal
from sluicegate import topics, wire
from sluicegate.config import PoolSettings
from sluicegate.errors import TransportError
from sluicegate.transport import Message, Transport
from sluicegate.wire_peer import wrap
from sluicegate.wire_pool import Completion

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A result ready to go back to its edge: the topic, the document's bytes (what a usage
    record's ``result_sha256`` digests), its correlation data and user properties."""

    topic: str
    payload: bytes
    correlation: bytes | None
    job_id: str
    props: tuple[tuple[str, str], ...] = ()
    crosses: bool = False  # to a sister campus's edge: over the bridge, in an envelope


class Replies:
    """Results and completion records of one worker, counted by status."""

    def __init__(
        self,
        settings: PoolSettings,
        transport: Transport,
        clock: Callable[[], float],
        campus: Callable[[], str] = lambda: "",
    ) -> None:
        """``campus``: this campus's name in the policy held now ("" while none is)."""
        self._settings = settings
        self._transport = transport
        self._clock = clock
        self._campus = campus
        self._ran_on = wire.RanOn(kind="pool", node=settings.id, zone=settings.zone)
        self.results: Counter[str] = Counter()
        self.unreturned = 0  # results with no valid edge id to return them to

    def result(
        self,
        job_id: str,
        edge_id: str | None,
        attempt: int,
        correlation_data: bytes | None,
        *,
        status: wire.Status,
        model: str | None,
        timings: wire.Timings,
        placed: bool = True,
        code: str | None = None,
        reason: str | None = None,
        outputs: wire.Outputs | None = None,
        hold: bool = False,
        peer: str = "",
    ) -> Outgoing | None:
        """The job's result, back to its edge (on sister campus ``peer`` when given); counted
        even when there is no edge to send it to. With ``hold`` it is built and returned,
        not sent, for the caller to send with :meth:`send` (once its usage record is on
        disk)."""
        self.results[status] += 1
        campus = self._campus() if peer else ""
        if peer and not campus:  # the work was refused before any policy was held
            edge_id = None
        if edge_id is None:
            self.unreturned += 1
            log.warning("result %s of job %r has no edge to return to", status, job_id[:128])
            return None
        result = wire.JobResult(
            job_id=job_id,
            status=status,
            code=code,
            reason=reason,
            model=model,
            outputs=outputs,
            ran_on=self._ran_on,
            timings_ms=timings,
            offload=wire.Offload(requested=True, placed=placed, worker=self._settings.id),
        )
        props = (
            (topics.PROP_JOB_ID, job_id),
            (topics.PROP_ATTEMPT, str(attempt)),
            (topics.PROP_WORKER, self._settings.id),
        )
        worker = self._settings.id
        out = Outgoing(
            topics.peer_returns(campus, peer, edge_id, worker)
            if peer
            else topics.edge_returns(edge_id, worker),
            wire.dump(result),
            correlation_data,
            job_id,
            props,
            crosses=bool(peer),
        )
        if not hold:
            self.send(out)
        return out

    def send(self, out: Outgoing) -> None:
        """Publish a result built with ``hold``."""
        self._publish(
            out.topic, out.payload, out.correlation, out.job_id, out.props, crosses=out.crosses
        )

    def completion(
        self,
        job_id: str,
        status: wire.Status,
        model: str,
        *,
        edge_id: str | None,
        attempt: int,
        service_ms: float,
        queue_ms: float,
        batch_size: int,
    ) -> None:
        record = Completion(
            job_id=job_id,
            worker_id=self._settings.id,
            status=status,
            model=model,
            service_ms=round(service_ms, 3),
            queue_ms=round(queue_ms, 3),
            batch_size=max(1, batch_size),
            ts=self._clock(),
            attempt=attempt,
            edge_id=edge_id,
        )
        self._publish(topics.completion(self._settings.id), wire.dump(record), None, job_id)

    def refusal(self, refusal: WorkRefusal) -> None:
        """Answer a refused job, and tell the broker if it had been placed here."""
        elapsed = (self._clock() - refusal.received_at) * 1000.0
        self.result(
            refusal.job_id,
            refusal.edge_id,
            refusal.attempt,
            refusal.correlation_data,
            status=refusal.status,
            model=refusal.model,
            code=refusal.code,
            reason=refusal.reason,
            timings=wire.Timings(total_ms=round(elapsed, 3)),
            placed=refusal.token_passed,
            peer=refusal.peer,
        )
        if refusal.token_passed:
            model = refusal.model or ""
            self.completion(
                refusal.job_id,
                refusal.status,
                model,
                edge_id=refusal.edge_id,
                attempt=refusal.attempt,
                service_ms=0.0,
                queue_ms=0.0,
                batch_size=1,
            )

    def _publish(
        self,
        topic: str,
        payload: bytes,
        correlation: bytes | None,
        job: str,
        props: tuple[tuple[str, str], ...] = (),
        *,
        crosses: bool = False,
    ) -> None:
        msg = Message(
            topic,
            payload,
            qos=1,
            correlation_data=correlation,
            content_type=wire.RESULT_CONTENT_TYPE,
            user_properties=props,
        )
        try:
            self._transport.publish_nowait(wrap(msg) if crosses else msg)
        except TransportError as exc:
            log.error("could not publish to %s for job %s: %s", topic, job, exc)
