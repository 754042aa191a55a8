"""The campus broker's asyncio shell: MQTT and Redis in, the placement core, tokens out.

It feeds the pure :class:`~broker.core.fleet.Fleet` from worker capabilities, telemetry, status
and completion records; decides each placement request (job metadata and the image's hash,
never the image), answered with a signed token or a refusal that says why by
:class:`~broker.answers.Answers`; hands the edges' telemetry to
:class:`~broker.edge_fleet.EdgeFleet`, which reads it between urgent work; and keeps what other
replicas and a restart need in Redis: atomic reservations, each placement in flight (edge,
worker, attempt), node documents that expire when a node goes silent, each job's status and
explanation; a placement its edge hands back unused frees its slot at once. Requests are
decided in batches — whatever arrived while the previous batch was in Redis — so a burst
costs one round trip. What happens to a placed job afterwards (its worker dies, a stale
completion) is the :class:`~broker.reaper.Reaper`'s. Every decision is written to the
signed, hash-chained audit log. It decides nothing itself: placements are the core's
(``broker.core.placement``), and how long a request waits, how long a reservation holds,
whether to decide again after another replica won the slot and the arrival rate are
``broker.core.service_rules``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis
from pydantic import BaseModel, ValidationError

from broker.announced import Announced
from broker.answers import Answers
from broker.core import service_rules
from broker.core.batch import NO_POLICY, decide_turn, settle
from broker.core.decision import Decision
from broker.core.demand import PoolDemand, PoolSignal
from broker.core.fleet import Fleet
from broker.core.identity import IdentityRefusal
from broker.core.params import FleetParams, PlacementParams, ServiceParams
from broker.core.sealing import sealable_in
from broker.core.shadow import Shadow
from broker.decision_audit import DecisionAudit
from broker.edge_fleet import EdgeFleet, EdgeRow
from broker.forwarding import Forwarder
from broker.gatekeeper import Gatekeeper
from broker.inbox import Inbox
from broker.inflight import InflightStore
from broker.metrics import BrokerMetrics
from broker.peers import Peers
from broker.reaper import Reaper
from broker.reservations import Reservations
from broker.store import BrokerStore
from broker.waiting_room import Pending, WaitingRoom
from policies import AsyncAuditWriter, Policy, SigningKey
from sluicegate import topics, wire
from sluicegate.config import BrokerSettings
from sluicegate.errors import StoreUnavailable, TransportError
from sluicegate.supervise import until_stopped
from sluicegate.transport import Message, Transport
from sluicegate.vision.manifest import Requirements
from sluicegate.wire_pool import (
    Completion,
    PlacementRelease,
    PlacementReply,
    PlacementRequest,
    WorkerCapabilities,
    WorkerTelemetry,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
BROKER_FAILED = "the broker failed; run locally"
FILLED_UP = "workers filled up while placing; run locally"


def status_message(settings: BrokerSettings, state: Literal["online", "offline"]) -> bytes:
    """The broker's retained status; the offline copy is its Last Will."""
    return wire.dump(wire.node_status(settings.id, "broker", "", state))


class Broker:
    """One broker replica. Create, then ``await run(stop)``."""

    def __init__(
        self,
        settings: BrokerSettings,
        transport: Transport,
        redis: aioredis.Redis,
        key: SigningKey,
        policy: Callable[[], Policy | None],
        audit: AsyncAuditWriter,
        *,
        requirements: dict[str, Requirements] | None = None,
        params: PlacementParams | None = None,
        shadow: Shadow | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self._transport = transport
        self._redis = redis
        self._key = key
        self._policy = policy
        self._clock = clock
        # Under the policy in force from the start; run.py hands it each new one.
        self.fleet = Fleet(FleetParams.from_settings(settings), requirements or {}, policy())
        self.params = params or PlacementParams.from_settings(settings)
        self.shadow = shadow  # a candidate deciding beside production, never acted on
        # Whoever keeps a view of the workers: production's fleet, and the shadow's.
        self._views: tuple[Fleet | Shadow, ...] = (self.fleet,) + ((shadow,) if shadow else ())
        self.service_params = ServiceParams()
        self.reservations = Reservations(
            redis, inflight_margin_ms=int(settings.inflight_margin_s * 1000)
        )
        self.metrics = BrokerMetrics()
        # Operators' holds (broker.console.holds): lines whose offload is paused (edge ->
        # why), workers out of placement; and who else hears each completion (the console).
        self.paused: dict[str, str] = {}
        self.cordoned: frozenset[str] = frozenset()
        self.completion_listeners: list[Callable[[Completion, float], None]] = []
        self._inbox = Inbox()
        self.audit = DecisionAudit(audit, clock)
        self.gate = Gatekeeper(policy, self.metrics, self.audit)
        self.waiting = WaitingRoom(
            settings.max_wait_ms,
            clock=clock,
            again=self._inbox.put,
            give_up=lambda item, reason: self.answers.refuse(item, None, "no_capacity", reason),
            gauge=self.metrics.waiting.set,
        )
        # Each pool's demand: its placements and the refusals for want of its workers.
        self.signal = PoolSignal(settings.announce_lead_s, self.service_params)
        self.announced = Announced(policy)  # the lines' announced work, as their edges say
        # Sister campuses: our halves and summaries out, theirs in (beside the policy file).
        halves = settings.policy_file.parent if settings.policy_file is not None else None
        self.peers = Peers(
            transport,
            policy,
            key,
            settings.id,
            self.fleet,
            halves,
            clock,
            interval_s=min(settings.telemetry_interval_s, 1.0),
            on_refused=lambda kind, reason: self.metrics.peer_refused.labels(kind, reason).inc(),
            place=self._inbox.put,
            refuse=lambda item, code, reason: self.answers.refuse(item, None, code, reason),
            release=lambda rel: self.reaper.release(rel, self.waiting.freed),
            link_lost=lambda peer: self.forwarder.link_lost(peer),
        )
        # Jobs no worker here can take, asked of a sister campus that may do better.
        self.forwarder = Forwarder(
            transport,
            policy,
            self.peers,
            clock,
            relay=lambda item, reply: self.answers.relay(item, reply),
            refuse=lambda item, code, reason: self.answers.refuse(item, None, code, reason),
            counted=lambda peer, outcome: self.metrics.peer_asked.labels(peer, outcome).inc(),
        )
        self.peers.hear(topics.peer_answers, self.forwarder.on_answer, sending_only=True)
        self.peers.hear(topics.peer_notices_all, self.forwarder.on_notice, sending_only=True)
        self.store = BrokerStore(redis, int(self.params.stale_after_s * 1000))
        self.answers = Answers(
            settings,
            transport,
            key,
            self.fleet,
            self.store,
            self.metrics,
            self.audit,
            self.service_params,
            clock,
        )
        self.edge_fleet = EdgeFleet(
            policy,
            self.store,
            self.metrics,
            clock,
            interval_s=settings.telemetry_interval_s,
            idle=self._inbox.idle,
        )
        self._reserve_ok = True
        self.listening = False  # subscribed to placement requests (readiness)
        self.inflight = InflightStore(redis, self.store)
        self.reaper = Reaper(
            settings,
            transport,
            self.inflight,
            self.store,
            self.fleet,
            self.metrics,
            self.audit,
            clock,
            stale_after_s=self.params.stale_after_s,
            to_peer=self.peers.notify,
        )

    # -- intake (event loop, quick) --------------------------------------------------------

    def on_request(self, msg: Message) -> None:
        # Who asks is the topic's (the ACL lets only that edge write it), and the answer
        # goes to that edge's own reply topic, whatever the message says.
        edge_id = topics.sender(msg.topic)
        reply_topic = topics.placement_replies(edge_id)
        try:
            request = PlacementRequest.model_validate_json(msg.payload)
        except ValidationError as exc:
            bad = PlacementReply(
                job_id="?", status="refused", code="bad_request", reason=f"{exc}"[:500]
            )
            self.answers.reply(reply_topic, msg.correlation_data, bad)
            return
        item = Pending(request, reply_topic, msg.correlation_data, time.perf_counter())
        policy = self._policy()
        if policy is None:
            self.answers.refuse(item, None, "no_policy", NO_POLICY)
            return
        origin = self.gate.origin(policy, edge_id, request.edge_id)
        if isinstance(origin, IdentityRefusal):
            self.answers.refuse(item, None, origin.code, origin.reason)
            return
        if request.origin_zone != origin:
            item.request = request.model_copy(update={"origin_zone": origin})
        if edge_id in self.paused:
            self.answers.refuse(item, None, "offload_paused", self.paused[edge_id])
            return
        self._inbox.put(item)

    def on_capabilities(self, msg: Message) -> None:
        caps = _parse(WorkerCapabilities, msg)
        if caps is not None and self.gate.worker(msg, caps.worker_id, caps.zone):
            for view in self._views:
                view.apply_capabilities(caps, self._clock())
            self.waiting.freed()
            self.store.node_document(caps.worker_id, "capabilities", msg.payload)

    def on_worker_telemetry(self, msg: Message) -> None:
        tel = _parse(WorkerTelemetry, msg)
        if tel is not None and self.gate.worker(msg, tel.node, tel.zone):
            for view in self._views:
                view.apply_telemetry(tel, self._clock())
            self.waiting.freed()
            self.store.node_document(tel.node, "telemetry", msg.payload)

    def on_worker_status(self, msg: Message) -> None:
        status = _parse(wire.NodeStatus, msg)
        if status is not None and status.node != topics.node_of(msg.topic):
            return  # a status about another node: only its own Last Will speaks for it
        if status is not None and status.state == "offline":
            for view in self._views:
                view.mark_offline(status.node, self._clock())
            self.reaper.worker_gone(status.node, "last_will")
            log.warning("worker %s went offline", status.node)

    def on_completion(self, msg: Message) -> None:
        done = _parse(Completion, msg)
        if done is None or not self.gate.own("completion", "worker", msg, done.worker_id):
            return
        for view in self._views:
            view.apply_completion(done, self._clock())
        self.waiting.freed()
        self.metrics.completions.labels(done.status).inc()
        self.metrics.job_seconds.observe(done.service_ms / 1000.0)
        self.reaper.completed(done)  # releases the worker's slot, then fences the attempt
        for listener in self.completion_listeners:
            listener(done, self._clock())

    def hold(self, cordoned: frozenset[str], paused: dict[str, str]) -> None:
        """Apply the operators' holds in force: ``cordoned`` workers take no new placement
        (in every view of the workers), requests from ``paused`` edges are refused with
        ``offload_paused`` and the reason (their jobs run on the line PC)."""
        for worker_id in cordoned ^ self.cordoned:
            for view in self._views:
                view.cordon(worker_id, worker_id in cordoned)
        self.cordoned = cordoned
        self.paused = paused

    def on_release(self, msg: Message) -> None:
        """An edge hands back a placement it will not use: the slot is free now, if it is
        the placement the job's record in Redis names (anything else changes nothing).
        Every replica hears it: Redis releases it once, and the replica whose view holds
        the reservation drops it there."""
        rel = _parse(PlacementRelease, msg)
        if rel is None or not self.gate.own("release", "edge", msg, rel.edge_id):
            return
        if topics.campus_of(rel.worker_id):  # a sister campus's worker: across
            self.forwarder.hand_back(rel)
        else:
            self.reaper.release(rel, self.waiting.freed)

    @property
    def edges(self) -> dict[str, EdgeRow]:
        """The latest telemetry of each edge the policy lists, as this replica heard it."""
        return self.edge_fleet.edges

    # -- deciding ------------------------------------------------------------------------------

    async def _placer(self) -> None:
        """Decide whatever has arrived, reserve in one Redis round trip, reply, repeat."""
        while True:
            batch = await self._inbox.batch()
            try:
                await self._place_batch(batch)
            except Exception:  # a fault in deciding still answers every request held
                log.exception("placement batch failed; refusing its %d requests", len(batch))
                for item in batch:
                    self.answers.refuse(item, None, "broker_error", BROKER_FAILED)
            self._inbox.done()

    async def _place_batch(self, batch: list[Pending]) -> None:
        policy = self._policy()
        todo = batch
        decisions = 0
        while todo:
            if decisions and not service_rules.decide_again(decisions, self.service_params):
                break
            decisions += 1
            now = self._clock()
            beside = None
            if self.shadow is not None and policy is not None and decisions == 1:
                beside = partial(self._beside, policy=policy, now=now)
            turn = decide_turn(
                self.fleet,
                todo,
                _request_of,
                policy,
                now=now,
                params=self.params,
                hold=self.waiting.hold,
                sealable=self._sealable(policy),
                beside=beside,
                # Only where a sister campus may take work: no cost per request elsewhere.
                forward=self.forwarder.forward if policy and policy.peers_out() else None,
            )
            for refused in turn.refused:
                self.answers.refuse(refused.item, refused.decision, refused.code, refused.reason)
            holds = [self.answers.hold(item.request, d, now) for item, d in turn.placed]
            try:
                granted = await self.reservations.reserve_many(holds, int(now * 1000))
                self._reserve_ok = True
            except StoreUnavailable as exc:  # Redis down: no reservation, no placement
                self._reserve_ok = False
                for item, decision in turn.placed:
                    self.fleet.release(item.request.job_id)
                    self.answers.refuse(item, decision, "broker_unavailable", str(exc))
                return
            settled = settle(self.fleet, turn.placed, granted, _request_of, now=now)
            for refused in settled.refused:
                self.answers.refuse(refused.item, refused.decision, refused.code, refused.reason)
            for item, decision in settled.granted:
                self.answers.grant(item, decision, policy)
            todo = settled.again
        for item in todo:
            self.answers.refuse(item, None, "no_capacity", FILLED_UP)

    def _sealable(
        self, policy: Policy | None
    ) -> Callable[[PlacementRequest], Callable[[str], bool] | None]:
        fleet = self.fleet

        def sealable(request: PlacementRequest) -> Callable[[str], bool] | None:
            if policy is None:
                return None
            return sealable_in(fleet, policy, request.data_class, sealed=request.sealed)

        return sealable

    def _beside(
        self, request: PlacementRequest, decision: Decision, *, policy: Policy, now: float
    ) -> None:
        """The shadow candidate decides the same request; only counted and kept."""
        assert self.shadow is not None
        try:
            compared = self.shadow.compare(request, decision, policy, now=now)
        except Exception:  # a candidate's fault must never touch production's answer
            log.exception(
                "shadow candidate failed on job %s (production unaffected)", request.job_id
            )
            return
        self.metrics.shadow.labels(compared.outcome).inc()
        if compared.outcome != "same" or compared.forbidden:
            log.debug("shadow: %s", compared)

    # -- Redis upkeep and the audit log ----------------------------------------------------

    @property
    def redis_ok(self) -> bool:
        return self._reserve_ok and self.store.ok

    def demand(self) -> tuple[PoolDemand, ...]:
        """Per pool: demand against capacity, the scaling signal behind ``/metrics``."""
        policy = self._policy()
        if policy is None:
            return ()
        return self.signal.demand(
            self.fleet, policy, self.announced.schedules.values(), self._clock()
        )

    async def job(self, job_id: str) -> dict[str, Any] | None:
        return await self.store.job(job_id)

    async def _housekeeping(self) -> None:
        interval = self.settings.telemetry_interval_s
        while True:
            await asyncio.sleep(min(interval, 1.0))  # silent workers: the reaper's sweep
            tick = min(interval, 1.0)
            answers = self.answers
            self.signal.tick(answers.placed_by_pool, answers.turned_away, self._policy(), tick)
            self.answers.placed_by_pool.clear()
            self.answers.turned_away.clear()
            self.store.flush_nodes()

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set."""
        t = self._transport
        await t.subscribe(topics.worker_all("capabilities"), self.on_capabilities)
        await t.subscribe(topics.worker_all("telemetry"), self.on_worker_telemetry, qos=0)
        await t.subscribe(topics.worker_all("status"), self.on_worker_status)
        await t.subscribe(topics.completions_all(), self.on_completion)
        await t.subscribe(topics.placement_releases_all(), self.on_release)
        await t.subscribe(topics.edge_announced_all(), self.announced.on_message)
        # A share each: no placement needs it (broker.edge_fleet).
        await t.subscribe(topics.edge_telemetry_shared(), self.edge_fleet.offer, qos=0)
        # QoS 0, like the replies (see _reply); and a stale request redelivered to another
        # replica would only reserve for nobody.
        await t.subscribe(topics.placement_requests_shared(), self.on_request, qos=0)
        self.listening = True  # requests published from now on reach a replica

        def announce() -> None:
            t.publish_nowait(
                Message(
                    topics.broker_status(self.settings.id),
                    status_message(self.settings, "online"),
                    qos=1,
                    retain=True,
                )
            )

        t.on_connect(announce)
        if t.connected:
            announce()
        tasks = [
            asyncio.create_task(self._placer(), name="placer"),
            asyncio.create_task(self.audit.run(), name="decision audit"),
            asyncio.create_task(self._housekeeping(), name="housekeeping"),
            asyncio.create_task(self.store.run(), name="Redis writer"),
            asyncio.create_task(self.edge_fleet.run(), name="edge telemetry"),
            asyncio.create_task(self.waiting.run(), name="waiting room"),
            asyncio.create_task(self.reaper.run(), name="reaper"),
            asyncio.create_task(self.reaper.watch_progress(self._views), name="stall watch"),
            asyncio.create_task(self.peers.run(), name="sister campuses"),
        ]
        log.info("broker %s serving placements", self.settings.id)
        try:
            await until_stopped(stop, tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(TransportError, TimeoutError):
                await asyncio.wait_for(
                    t.publish(
                        Message(
                            topics.broker_status(self.settings.id),
                            status_message(self.settings, "offline"),
                            qos=1,
                            retain=True,
                        ),
                        wait=True,
                    ),
                    2.0,
                )


def _request_of(item: Pending) -> PlacementRequest:
    return item.request


def _parse(model: type[M], msg: Message) -> M | None:
    try:
        return model.model_validate_json(msg.payload)
    except ValidationError as exc:
        log.warning("ignored a malformed message on %s: %s", msg.topic, str(exc)[:300])
        return None
