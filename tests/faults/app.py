"""An at-least-once vision app and a campus observer, both on our own MQTT transport.

:class:`App` submits jobs with QoS 1 and known job ids (correlation data = the job id), on
a persistent session so results queued for it survive its own reconnects and a Mosquitto
restart. It records every raw result delivery in a :class:`~tests.faults.ledger.Ledger`,
without the Python client's deduplication, and waits for results with a bound, never a
sleep. It can resubmit, under the same job id, a job that got no result in time, as a real
at-least-once client would; the fault tests leave that off so a lost job shows as lost.

:class:`Observer` listens to the campus's own traffic (completions, placements, work
messages, returns, notices, statuses) and keeps a timeline, so a test can act "while the
broker places" or "while a worker holds a batch", and a benchmark can count executions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from sluicegate import topics, wire_pool
from sluicegate.config import MqttSettings
from sluicegate.errors import TransportError
from sluicegate.identity import certificate_name
from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Message
from tests.faults.ledger import Ledger

MODEL = "defect-v1"
DATA_CLASS = "wafer-image"


@dataclass(frozen=True)
class Request:
    """What the app resubmits unchanged."""

    edge: str
    job_id: str
    payload: bytes
    model: str
    data_class: str
    deadline_ms: float | None


class App:
    """Submit with QoS 1, count raw results per job id."""

    def __init__(
        self,
        settings: MqttSettings,
        *,
        ledger: Ledger | None = None,
        client_id: str | None = None,
        session_expiry_s: int = 3600,
    ) -> None:
        """``settings``: the app's login (its certificate names its client id)."""
        self.ledger = ledger or Ledger()
        self.client_id = (
            certificate_name(settings) or client_id or f"fault-app-{uuid.uuid4().hex[:8]}"
        )
        self.response_topic = topics.client_results(self.client_id)
        self._transport = MqttTransport(
            settings,
            client_id=self.client_id,
            clean_start=False,
            session_expiry_s=session_expiry_s,
            max_pending=65_535,  # the most MQTT allows in flight: results never wait on us
        )
        self._requests: dict[str, Request] = {}
        self._changed = asyncio.Event()
        self.ack_failures: Counter[str] = Counter()

    async def start(self) -> App:
        await self._transport.connect(10.0)
        await self._transport.subscribe(self.response_topic, self._on_result, qos=1)
        return self

    async def close(self) -> None:
        await self._transport.close()

    def _on_result(self, msg: Message) -> None:
        self.ledger.delivered(msg.payload, msg.correlation_data, time.monotonic())
        self._changed.set()

    async def submit(
        self,
        edge: str,
        job_id: str,
        payload: bytes,
        *,
        model: str = MODEL,
        data_class: str = DATA_CLASS,
        deadline_ms: float | None = None,
        ack_timeout: float = 30.0,
    ) -> bool:
        """Publish one job (QoS 1) and wait for Mosquitto's PUBACK; True once acked."""
        request = Request(edge, job_id, payload, model, data_class, deadline_ms)
        self._requests[job_id] = request
        return await self._publish(request, ack_timeout)

    async def resubmit(self, job_id: str, ack_timeout: float = 30.0) -> bool:
        """Publish the same request again (same job id), as an at-least-once app does."""
        return await self._publish(self._requests[job_id], ack_timeout)

    async def _publish(self, req: Request, ack_timeout: float) -> bool:
        props = [
            (topics.PROP_MODEL, req.model),
            (topics.PROP_DATA_CLASS, req.data_class),
            (topics.PROP_JOB_ID, req.job_id),
        ]
        if req.deadline_ms is not None:
            props.append((topics.PROP_DEADLINE_MS, repr(req.deadline_ms)))
        self.ledger.published(req.job_id, req.edge, time.monotonic())
        try:
            await asyncio.wait_for(
                self._transport.publish(
                    Message(
                        topics.edge_submit(req.edge),
                        req.payload,
                        qos=1,
                        response_topic=self.response_topic,
                        correlation_data=req.job_id.encode(),
                        content_type="image/jpeg",
                        user_properties=tuple(props),
                    ),
                    wait=True,
                ),
                ack_timeout,
            )
        except (TimeoutError, TransportError) as exc:
            self.ack_failures[type(exc).__name__] += 1
            return False
        self.ledger.acked(req.job_id, time.monotonic())
        return True

    async def wait_results(self, timeout: float) -> list[str]:
        """Wait until every accepted job has a result, at most ``timeout`` s; returns the
        accepted job ids still without one."""
        deadline = time.monotonic() + timeout
        while missing := self.ledger.pending():
            left = deadline - time.monotonic()
            if left <= 0:
                return missing
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
        return []


@dataclass
class Event:
    at: float  # time.monotonic()
    kind: str  # completion, request, reply, work, return, notice, status, retained-status
    node: str  # who produced it (worker, broker, edge) or whom it is about
    job_id: str | None = None
    attempt: int | None = None
    detail: str = ""


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)
    # job id -> (worker, attempt, status) of each completion a worker reported
    completions: dict[str, list[tuple[str, int, str]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def count(self, kind: str, node: str | None = None, since: float = 0.0) -> int:
        return sum(
            1
            for e in self.events
            if e.kind == kind and e.at >= since and (node is None or e.node == node)
        )

    def first(self, kind: str, node: str | None, since: float) -> Event | None:
        for e in self.events:
            if e.kind == kind and e.at >= since and (node is None or e.node == node):
                return e
        return None


class Observer:
    """Watch the campus's internal topics; never publishes."""

    def __init__(self, settings: MqttSettings) -> None:
        """``settings``: the wiretap's login (it may read every campus topic)."""
        self.timeline = Timeline()
        self._hooks: list[Callable[[], None]] = []
        self._transport = MqttTransport(
            settings,
            client_id=certificate_name(settings) or f"fault-observer-{uuid.uuid4().hex[:8]}",
            max_pending=65_535,
        )

    async def start(self, *, work: bool = True) -> Observer:
        await self._transport.connect(10.0)
        sub = self._transport.subscribe
        await sub(topics.completions_all(), self._on_completion, qos=0)
        await sub(topics.placement_requests_all(), self._on_request, qos=0)
        await sub(topics.placement_replies("+"), self._on_reply, qos=0)
        await sub(topics.edge_returns_all("+"), self._on_return, qos=0)
        await sub(topics.edge_notices("+"), self._on_notice, qos=0)
        await sub(topics.edge_status_all(), self._on_status, qos=0)
        await sub(topics.worker_all("status"), self._on_status, qos=0)
        await sub(topics.broker_status("+"), self._on_status, qos=0)
        if work:
            await sub(f"{topics.ROOT}/pool/#", self._on_work, qos=0)
        return self

    async def close(self) -> None:
        await self._transport.close()

    def _add(self, event: Event) -> None:
        self.timeline.events.append(event)
        for hook in list(self._hooks):
            hook()

    def _on_completion(self, msg: Message) -> None:
        with contextlib.suppress(ValueError):
            c = wire_pool.Completion.model_validate_json(msg.payload)
            self.timeline.completions[c.job_id].append((c.worker_id, c.attempt, c.status))
            self._add(Event(time.monotonic(), "completion", c.worker_id, c.job_id, c.attempt))

    def _on_request(self, msg: Message) -> None:
        with contextlib.suppress(ValueError):
            r = wire_pool.PlacementRequest.model_validate_json(msg.payload)
            self._add(Event(time.monotonic(), "request", r.edge_id, r.job_id, r.attempt))

    def _on_reply(self, msg: Message) -> None:
        with contextlib.suppress(ValueError):
            r = wire_pool.PlacementReply.model_validate_json(msg.payload)
            node = r.broker_id or "broker"
            self._add(Event(time.monotonic(), "reply", node, r.job_id, None, r.status))

    def _on_work(self, msg: Message) -> None:
        levels = msg.topic.split("/")
        if len(levels) < 3 or levels[-2] != "work":  # .../<worker>/work/<edge>
            return
        worker = levels[-3]
        attempt = msg.user_property(topics.PROP_ATTEMPT)
        self._add(
            Event(
                time.monotonic(),
                "work",
                worker,
                msg.user_property(topics.PROP_JOB_ID),
                int(attempt) if attempt and attempt.isdigit() else None,
            )
        )

    def _on_return(self, msg: Message) -> None:
        worker = msg.user_property(topics.PROP_WORKER) or "?"
        attempt = msg.user_property(topics.PROP_ATTEMPT)
        self._add(
            Event(
                time.monotonic(),
                "return",
                worker,
                msg.user_property(topics.PROP_JOB_ID),
                int(attempt) if attempt and attempt.isdigit() else None,
            )
        )

    def _on_notice(self, msg: Message) -> None:
        with contextlib.suppress(ValueError):
            n = wire_pool.JobNotice.model_validate_json(msg.payload)
            self._add(Event(time.monotonic(), "notice", n.worker_id, n.job_id, n.attempt, n.kind))

    def _on_status(self, msg: Message) -> None:
        # A retained copy (on subscribing, or resubscribing after a reconnect) may be stale:
        # it is kept apart from a live change.
        node = msg.topic.rsplit("/", 2)[-2]
        state = "online" if b'"online"' in msg.payload else "offline"
        kind = "retained-status" if msg.retain else "status"
        self._add(Event(time.monotonic(), kind, node, None, None, state))

    async def wait_for(
        self, check: Callable[[Timeline], bool], timeout: float, *, poll_s: float = 0.05
    ) -> bool:
        """Wait until ``check(timeline)`` holds, at most ``timeout`` s. ``check`` runs after
        every single event (so a passing state between two events is not missed) and at
        least every ``poll_s`` (it may read state other than events)."""
        held = asyncio.Event()

        def hook() -> None:
            if check(self.timeline):
                held.set()

        self._hooks.append(hook)
        deadline = time.monotonic() + timeout
        try:
            while not (held.is_set() or check(self.timeline)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(held.wait(), min(left, poll_s))
            return True
        finally:
            self._hooks.remove(hook)
