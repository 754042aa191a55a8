"""What the broker answers a placement request, and everything an answer carries with it.

A request the core placed and Redis reserved becomes a signed token bound to its worker
(and to the worker's sealing key when the job must travel sealed): :meth:`Answers.grant`;
anything else becomes a refusal that says why: :meth:`Answers.refuse`. Each answer goes to
the asking edge's own reply topic at QoS 0, is counted, timed and written to the audit log
and to the job's record. :meth:`Answers.hold` says how long the reservation behind a
placement holds (``broker.core.service_rules``). It decides nothing: the placement is the
core's, the reservation ``broker.reservations``'.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from broker.core import service_rules
from broker.core.decision import Decision, Placed
from broker.core.demand import WANTED
from broker.core.fleet import Fleet
from broker.core.params import ServiceParams
from broker.core.sealing import SealUnavailable, advertised_key, seal_binding
from broker.decision_audit import DecisionAudit, decision_record, encode
from broker.metrics import BrokerMetrics
from broker.reservations import Hold
from broker.store import BrokerStore
from broker.waiting_room import Pending
from policies import Policy, SigningKey, mint
from policies.errors import PolicyError
from policies.evaluate import peer_of_origin
from policies.sealing import seal_key_text
from sluicegate import topics, wire
from sluicegate.config import BrokerSettings
from sluicegate.transport import Message, Transport
from sluicegate.wire_pool import PlacementReply, PlacementRequest


class Answers:
    """Grants and refusals, as one broker replica sends them."""

    def __init__(
        self,
        settings: BrokerSettings,
        transport: Transport,
        key: SigningKey,
        fleet: Fleet,
        store: BrokerStore,
        metrics: BrokerMetrics,
        audit: DecisionAudit,
        service_params: ServiceParams,
        clock: Callable[[], float],
    ) -> None:
        self._settings = settings
        self._transport = transport
        self._key = key
        self._fleet = fleet
        self._store = store
        self._metrics = metrics
        self._audit = audit
        self._service_params = service_params
        self._clock = clock
        self._decided = {s: metrics.decisions.labels(s) for s in ("placed", "refused")}
        self.placed_by_pool: Counter[str] = Counter()  # grants since the last tick, per pool
        # Refusals for want of a worker since the last tick, by (data class, origin zone).
        self.turned_away: Counter[tuple[str, str]] = Counter()
        # Sister campuses' asks answered here: (peer, "placed" or the refusal's code).
        self.for_peers: Counter[tuple[str, str]] = Counter()
        self._pools: tuple[bytes, dict[str, str]] = (b"", {})  # policy digest, worker -> pool

    def hold(self, request: PlacementRequest, decision: Placed, now: float) -> Hold:
        state = self._fleet.state(decision.worker_id)
        latest = state.latest if state is not None else None
        capacity = latest.capacity if latest is not None else 1
        until = service_rules.reservation_until(
            now,
            token_ttl_s=self._settings.token_ttl_s,
            deadline_at=request.deadline_at,
            params=self._service_params,
        )
        until_ms = int(until * 1000)
        # A sister campus's job: its edge recorded as ``<edge>@<campus>``, so a notice of a
        # lost worker goes back across and a release from there matches the record.
        peer = peer_of_origin(request.origin_zone)
        edge = topics.peer_edge(request.edge_id, peer) if peer else request.edge_id
        return Hold(
            decision.worker_id,
            request.job_id,
            capacity,
            until_ms,
            edge,
            request.attempt,
            request.deadline_at,
        )

    def grant(self, item: Pending, decision: Placed, policy: Policy | None) -> None:
        assert policy is not None
        req = item.request
        sealing = seal_binding(
            policy,
            decision.worker_id,
            advertised_key(self._fleet, decision.worker_id),
            req.data_class,
            seal_all=self._settings.seal_all,
            sealed=req.sealed,
        )
        if isinstance(sealing, SealUnavailable):
            self._fleet.release(req.job_id)
            self._store.release(decision.worker_id, req.job_id)
            self.refuse(item, decision, sealing.code, sealing.reason)
            return
        try:
            token = mint(
                policy,
                self._key,
                job_id=req.job_id,
                payload_sha256=bytes.fromhex(req.payload_sha256),
                data_class=req.data_class,
                origin_zone=req.origin_zone,
                target_worker=decision.worker_id,
                now=self._clock(),
                ttl_s=self._settings.token_ttl_s,
                seal_key_id=sealing,
            )
        except PolicyError as exc:  # the core and the policy library disagree: refuse
            self._fleet.release(req.job_id)
            self._store.release(decision.worker_id, req.job_id)
            self.refuse(item, decision, exc.reason, f"token not minted: {exc}")
            return
        reply = PlacementReply(
            job_id=req.job_id,
            status="placed",
            token=token,
            worker_id=decision.worker_id,
            worker_zone=decision.zone,
            work_topic=topics.pool_work(decision.zone, decision.worker_id, req.edge_id),
            predicted_ms=round(decision.predicted_ms, 3),
            broker_id=self._settings.id,
        )
        peer = peer_of_origin(req.origin_zone)
        if peer:  # a sister campus's job: its edge sends the image across the bridge
            public = policy.seal_key(decision.worker_id, sealing)
            reply = reply.model_copy(
                update={
                    "campus": policy.campus,
                    "work_topic": topics.peer_work(
                        peer, policy.campus, decision.worker_id, req.edge_id
                    ),
                    "seal_key": seal_key_text(public) if public is not None else None,
                }
            )
        self.placed_by_pool[self._pool_of(policy, decision.worker_id)] += 1
        self._finish(item, decision, reply)

    def _pool_of(self, policy: Policy, worker_id: str) -> str:
        if self._pools[0] != policy.digest:
            self._pools = (policy.digest, {w: p.name for p in policy.pools for w in p.workers})
        return self._pools[1].get(worker_id, "?")

    def relay(self, item: Pending, reply: PlacementReply) -> None:
        """A sister campus's placement for ``item``, to the edge that asked (audited, timed
        and counted as this replica's answer; the edge checks the peer's token)."""
        self._finish(item, None, reply)

    def refuse(self, item: Pending, decision: Decision | None, code: str, reason: str) -> None:
        reply = PlacementReply(
            job_id=item.request.job_id,
            status="refused",
            code=code,
            reason=reason,
            broker_id=self._settings.id,
        )
        self._metrics.refusals.labels(code).inc()
        if code in WANTED:
            self.turned_away[item.request.data_class, item.request.origin_zone] += 1
        self._finish(item, decision, reply)

    def _finish(self, item: Pending, decision: Decision | None, reply: PlacementReply) -> None:
        self.reply(item.reply_topic, item.correlation, reply)
        peer = peer_of_origin(item.request.origin_zone)
        if peer:
            self.for_peers[(peer, reply.code or reply.status)] += 1
        self._decided[reply.status].inc()
        self._metrics.decision_seconds.observe(time.perf_counter() - item.arrived)
        req = item.request
        text = encode(decision_record(req, reply, decision))  # for the log and the job alike
        self._audit.add(req.job_id, text)
        self._store.job_decision(req.job_id, text)

    def reply(self, topic: str, correlation: bytes | None, reply: PlacementReply) -> None:
        # QoS 0: a request and its reply are worth something only while the edge waits (its
        # placement timeout, 50 ms by default, far shorter than any redelivery would take);
        # a lost one costs that wait and the reservation expires.
        # QoS 1 would add a PUBACK to read per decision, here and at the edge.
        self._transport.publish_nowait(
            Message(
                topic,
                wire.dump(reply),
                qos=0,
                correlation_data=correlation,
                content_type=wire.RESULT_CONTENT_TYPE,
            )
        )
