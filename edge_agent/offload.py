"""Edge offload: ask the campus broker where a job should run, check its answer, send it.

The pure part checks the broker's placement against the edge's own verified copy of the
policy (:func:`check_placement`); whether to ask at all is the lifecycle's rule
(``edge_agent.rules.offer_reason``).
The shell part, :class:`PlacementClient`, is a request/response over MQTT (each request with
correlation data of its own, every wait racing a timeout) and the publish of the image
straight to the chosen worker's zone-scoped work topic. It never blocks the loop and never
loses a job: every path that does not end in a verified placement hands the job back to run
locally, with the reason, so its result can say why it was not offloaded. Each placement of
a job is numbered (``attempt``, in the request and on the work message); the worker returns
the result to this edge's returns topic, named as the work message's response topic. A
placement the edge will not use (answered too late, refused by its own checks, or no longer
wanted) is handed back (:meth:`PlacementClient.release`), so its worker's slot is free at
once. A placement on a sister campus's worker, which this campus's broker relays, is checked
against that campus's keys and terms in this edge's policy (``policies.tokens.verify_peer``)
and its work goes across the bridge in a ``wire_peer`` envelope (``topics.peer_work``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from pydantic import ValidationError

from edge_agent.admission import Job, Owners
from edge_agent.rules import Declined, Placement
from policies import PlacementClaims, Policy, verify
from policies.errors import PolicyError
from policies.sealing import decode_seal_key, seal, seal_key_id
from policies.tokens import verify_peer
from sluicegate import topics, wire
from sluicegate.errors import TransportError
from sluicegate.transport import Message, Transport
from sluicegate.wire_peer import wrap
from sluicegate.wire_pool import PlacementRelease, PlacementReply, PlacementRequest

log = logging.getLogger(__name__)
GIVEN_UP_KEPT = 1024  # requests given up whose late answer is still handed back if placed


@dataclass(slots=True)
class _Request:
    """A placement request on its way, known by its correlation data: what checking its
    answer needs, and the future its outcome goes to."""

    job: Job
    attempt: int
    digest: bytes
    outcome: asyncio.Future[Placement | Declined]
    timer: asyncio.TimerHandle | None = None

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def check_placement(
    reply: PlacementReply,
    job: Job,
    payload_sha256: bytes,
    policy: Policy | None,
    *,
    edge_id: str,
    origin_zone: str,
    now: float,
) -> Placement | Declined:
    """Turn the broker's reply into a placement this edge trusts, or a reason to stay local."""
    if reply.status != "placed":
        return Declined(reply.code or "refused", reply.reason or "the broker gave no reason")
    if policy is None:
        return Declined("no_policy", "this edge holds no verified policy yet to check tokens")
    if not (reply.token and reply.worker_id and reply.worker_zone):
        return Declined("bad_reply", "the broker's placement lacks a token, worker or zone")
    if reply.campus is not None and reply.campus != policy.campus:
        peer, token = reply.campus, reply.token
        return _check_peer_placement(reply, peer, token, job, payload_sha256, policy, edge_id, now)
    try:
        claims = verify(
            reply.token,
            policy,
            now=now,
            job_id=job.job_id,
            payload_sha256=payload_sha256,
            origin_zone=origin_zone,
            data_class=job.data_class,
        )
    except PolicyError as exc:
        return Declined(exc.reason, f"placement token refused by the edge: {exc}")
    mismatch = _target_mismatch(reply, claims, "the token")
    if mismatch is not None:
        return mismatch
    work_topic = topics.pool_work(claims.target_zone, claims.target_worker, edge_id)
    seal_to = None
    if claims.sealed:  # verify checked that this edge's policy lists the key for the worker
        seal_to = policy.seal_key(claims.target_worker, claims.seal_key_id)
        if seal_to is None:
            return Declined("token.unknown_seal_key", "the token binds a key the policy lacks")
    return Placement(
        claims.target_worker,
        claims.target_zone,
        work_topic,
        reply.token,
        payload_sha256,
        reply.predicted_ms,
        claims,
        seal_to,
    )


def _target_mismatch(reply: PlacementReply, claims: PlacementClaims, whose: str) -> Declined | None:
    """A reply naming another worker or zone than the token it carries binds."""
    if claims.target_worker == reply.worker_id and claims.target_zone == reply.worker_zone:
        return None
    return Declined(
        "bad_reply",
        f"reply names {reply.worker_id}@{reply.worker_zone} but {whose} binds "
        f"{claims.target_worker}@{claims.target_zone}",
    )


def _placed_on(reply: PlacementReply) -> str:
    """The worker a placed reply names, as this edge names it."""
    assert reply.worker_id is not None
    if reply.campus is None:
        return reply.worker_id
    return topics.peer_worker(reply.worker_id, reply.campus)


def _check_peer_placement(
    reply: PlacementReply,
    peer: str,
    token: str,
    job: Job,
    payload_sha256: bytes,
    policy: Policy,
    edge_id: str,
    now: float,
) -> Placement | Declined:
    """A sister campus's placement, relayed by this campus's broker: its broker's token
    checked against the keys and terms this edge's policy holds for that campus, and the
    worker's sealing key, which the reply carries, against the id the token binds."""
    try:
        claims = verify_peer(
            token,
            policy,
            peer,
            now=now,
            job_id=job.job_id,
            payload_sha256=payload_sha256,
            data_class=job.data_class,
        )
    except PolicyError as exc:
        return Declined(exc.reason, f"{peer}'s placement token refused by the edge: {exc}")
    mismatch = _target_mismatch(reply, claims, f"{peer}'s token")
    if mismatch is not None:
        return mismatch
    seal_to = None
    if claims.sealed:
        try:
            seal_to = decode_seal_key(reply.seal_key or "")
        except ValueError as exc:
            return Declined("token.unknown_seal_key", f"{peer}'s worker key is unreadable: {exc}")
        if seal_key_id(seal_to) != claims.seal_key_id:
            return Declined(
                "token.unknown_seal_key",
                f"the key {peer}'s reply carries is not the one its token binds "
                f"({claims.seal_key_id.hex()})",
            )
    return Placement(
        topics.peer_worker(claims.target_worker, peer),
        claims.target_zone,
        topics.peer_work(policy.campus, peer, claims.target_worker, edge_id),
        token,
        payload_sha256,
        reply.predicted_ms,
        claims,
        seal_to,
        campus=peer,
    )


class PlacementClient:
    """Placement requests to the broker and work messages to workers, for one edge."""

    def __init__(
        self,
        transport: Transport,
        *,
        edge_id: str,
        zone: str,
        policy: Callable[[], Policy | None],
        timeout_s: float,
        clock: Callable[[], float],
        model_sha256: Callable[[str], str | None] = lambda _model: None,
    ) -> None:
        self._transport = transport
        self._edge_id = edge_id
        self._owners = Owners(edge_id)  # the app each job is billed to
        # The sha256 of the model file this edge runs under a name: a job goes only to a
        # worker holding exactly that file.
        self._model_sha256 = model_sha256
        self._zone = zone
        self._policy = policy
        self._timeout_s = timeout_s
        self._clock = clock
        self._pending: dict[bytes, _Request] = {}  # by correlation data
        self._given_up: OrderedDict[bytes, _Request] = OrderedDict()  # answer may still come
        self._requests = itertools.count(1)
        self.released = 0  # placements handed back unused
        self._brokers_online: set[str] = set()
        self.reply_topic = topics.placement_replies(edge_id)

    async def start(self) -> None:
        await self._transport.subscribe(self.reply_topic, self._on_reply, qos=1)
        await self._transport.subscribe(topics.broker_status("+"), self._on_broker_status)

    def origin_zone(self, policy: Policy | None) -> str:
        """This edge's zone: its policy entry's (what the broker binds into tokens), or the
        configured one while the policy does not list it."""
        entry = policy.edge(self._edge_id) if policy is not None else None
        return entry.zone if entry is not None else self._zone

    def policy(self) -> Policy | None:
        """The policy placements are checked against now."""
        return self._policy()

    @property
    def broker_available(self) -> bool:
        return bool(self._brokers_online) and self._transport.connected

    def _on_broker_status(self, msg: Message) -> None:
        broker = msg.topic.split("/")[-2]
        try:
            state = wire.NodeStatus.model_validate_json(msg.payload).state
        except ValidationError:
            return
        if state == "online":
            self._brokers_online.add(broker)
        else:
            self._brokers_online.discard(broker)

    def _on_reply(self, msg: Message) -> None:
        """The broker's answer: checked here, in the handler, and handed to whoever waits
        (one turn of the loop less than a task of its own would take)."""
        key = msg.correlation_data or b""
        asked = self._pending.pop(key, None)
        if asked is None:  # given up (timed out, dropped), or answered already
            gone = self._given_up.pop(key, None)
            if gone is not None:
                with contextlib.suppress(ValidationError):
                    self._late(gone, PlacementReply.model_validate_json(msg.payload))
            return
        asked.stop_timer()
        try:
            reply = PlacementReply.model_validate_json(msg.payload)
        except ValidationError as exc:
            asked.outcome.set_result(
                Declined("bad_reply", f"the broker's reply is malformed: {exc}")
            )
            return
        policy = self._policy()
        checked = check_placement(
            reply,
            asked.job,
            asked.digest,
            policy,
            edge_id=self._edge_id,
            origin_zone=self.origin_zone(policy),
            now=self._clock(),
        )
        if isinstance(checked, Declined) and reply.status == "placed" and reply.worker_id:
            why = f"{checked.code}: {checked.reason}"
            self.release(asked.job.job_id, _placed_on(reply), asked.attempt, why)
        asked.outcome.set_result(checked)

    def _timed_out(self, key: bytes) -> None:
        asked = self._pending.pop(key, None)
        if asked is not None:
            ms = self._timeout_s * 1000.0
            why = f"the broker did not answer within {ms:.0f} ms"
            asked.outcome.set_result(Declined("broker_timeout", why))
            self._give_up(key, asked)

    def _settled(self, key: bytes, outcome: asyncio.Future[Placement | Declined]) -> None:
        if outcome.cancelled():  # dropped by its caller: an answer may still come
            asked = self._pending.pop(key, None)
            if asked is not None:
                asked.stop_timer()
                self._give_up(key, asked)

    def _late(self, asked: _Request, reply: PlacementReply) -> None:
        """An answer nobody waits for any more (the job went on without it): a placement
        in it is handed back, so that its slot does not stay taken until it expires."""
        if reply.status == "placed" and reply.worker_id and reply.job_id == asked.job.job_id:
            ms = self._timeout_s * 1000.0
            why = f"placed after the edge stopped waiting ({ms:.0f} ms)"
            self.release(reply.job_id, _placed_on(reply), asked.attempt, why)

    def _give_up(self, key: bytes, asked: _Request) -> None:
        """Stop waiting; an answer that still comes is handed back as it arrives."""
        self._given_up[key] = asked
        while len(self._given_up) > GIVEN_UP_KEPT:
            self._given_up.popitem(last=False)

    def release(self, job_id: str, worker_id: str, attempt: int, reason: str) -> None:
        """Hand ``attempt`` of ``job_id``, placed on ``worker_id`` and never sent there,
        back to the broker (which hands a sister campus's worker's back across). If this is
        lost, the reservation expires by itself."""
        self.released += 1
        release = PlacementRelease(
            job_id=job_id,
            edge_id=self._edge_id,
            worker_id=worker_id,
            attempt=attempt,
            reason=reason[:300],
        )
        log.info("job %s: placement %d on %s handed back: %s", job_id, attempt, worker_id, reason)
        try:
            topic = topics.placement_release(self._edge_id)
            self._transport.publish_nowait(Message(topic, wire.dump(release), qos=1))
        except TransportError as exc:
            log.warning("could not hand back the placement of job %s: %s", job_id, exc)

    def place(
        self, job: Job, reason: str, local_estimate_s: float, *, attempt: int = 1
    ) -> asyncio.Future[Placement | Declined]:
        """Ask for placement ``attempt`` of ``job`` now (the request is out before this
        returns) and return the future of its checked outcome; any failure is a
        :class:`Declined`. Cancelling the future gives the request up."""
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[Placement | Declined] = loop.create_future()
        if not self.broker_available:
            outcome.set_result(
                Declined("no_broker", "no campus broker is online; the job runs locally")
            )
            return outcome
        digest = hashlib.sha256(job.payload).digest()
        request = PlacementRequest(
            job_id=job.job_id,
            edge_id=self._edge_id,
            model=job.model,
            model_sha256=self._model_sha256(job.model),
            data_class=job.data_class,
            payload_sha256=digest.hex(),
            payload_bytes=len(job.payload),
            priority=job.priority,
            deadline_at=job.deadline,
            submitted_at=job.received_at,
            local_estimate_ms=round(local_estimate_s * 1000.0, 3),
            reason="deadline" if reason == "deadline" else "queue",
            # Half our timeout: an answer after a wait still reaches us before we give up.
            max_wait_ms=round(self._timeout_s * 500.0, 3),
            attempt=attempt,
        )
        # Correlation data of its own, so an answer is never taken for another request's,
        # however the requests for one job overlap.
        key = f"{job.job_id}/{attempt}/{next(self._requests)}".encode()
        try:
            self._transport.publish_nowait(
                Message(
                    topics.placement_request(self._edge_id),
                    wire.dump(request),
                    qos=0,
                    response_topic=self.reply_topic,
                    correlation_data=key,
                    content_type=wire.RESULT_CONTENT_TYPE,
                )
            )
        except TransportError as exc:  # a transport failure keeps the job here
            outcome.set_result(Declined("broker_unreachable", f"could not ask the broker: {exc}"))
            return outcome
        asked = self._pending[key] = _Request(job, attempt, digest, outcome)
        asked.timer = loop.call_later(self._timeout_s, self._timed_out, key)
        outcome.add_done_callback(partial(self._settled, key))
        return outcome

    def send(self, job: Job, placement: Placement, *, attempt: int = 1) -> None:
        """Publish the image straight to the worker, with everything it needs to verify it
        and to return the result to this edge as ``attempt``. When the token binds a sealing
        key the image goes sealed to it (only that worker, only this placement, can open
        it); it is never sent in the clear under such a token."""
        policy = self._policy()
        props = [
            (topics.PROP_JOB_ID, job.job_id),
            (topics.PROP_MODEL, job.model),
            (topics.PROP_TOKEN, placement.token),
            (topics.PROP_DATA_CLASS, job.data_class),
            (topics.PROP_ORIGIN_ZONE, self.origin_zone(policy)),
            (topics.PROP_EDGE, self._edge_id),
            (topics.PROP_PRIORITY, str(job.priority)),
            (topics.PROP_ATTEMPT, str(attempt)),
        ]
        owner = self._owners.of(policy, job.response_topic)
        if owner:  # the app the worker's usage record bills
            props.append((topics.PROP_OWNER, owner))
        if job.deadline is not None:
            props.append((topics.PROP_DEADLINE_AT, repr(job.deadline * 1000.0)))
        sha256 = self._model_sha256(job.model)
        if sha256 is not None:
            props.append((topics.PROP_MODEL_SHA256, sha256))
        payload, content_type = job.payload, f"image/{job.image.format}"
        claims = placement.claims
        if claims is not None and claims.sealed:
            if placement.seal_to is None:  # not reachable through check_placement
                raise TransportError(f"job {job.job_id}: sealed placement without its key")
            payload = seal(placement.seal_to, job.payload, claims.seal_info())
            props.append((topics.PROP_SEALED, topics.SEAL_SUITE))
            props.append((topics.PROP_INNER_CONTENT_TYPE, content_type))
            content_type = topics.SEALED_CONTENT_TYPE
        work = Message(
            placement.work_topic,
            payload,
            qos=1,
            response_topic=topics.edge_returns(self._edge_id, placement.worker_id),
            correlation_data=job.correlation_data,
            content_type=content_type,
            user_properties=tuple(props),
        )
        # To a sister campus's worker: across the bridge, which carries no MQTT property.
        self._transport.publish_nowait(wrap(work) if placement.campus else work)

    def close(self) -> None:
        pending, self._pending = self._pending, {}
        for asked in pending.values():
            asked.stop_timer()
            asked.outcome.cancel()
