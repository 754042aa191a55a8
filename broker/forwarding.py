"""A replica's asks to sister campuses for the jobs no worker here can take, and the peers'
answers relayed to the edges that asked.

The placement turn (``broker.core.batch``) offers each request the local decision refused
for want of a worker to :meth:`Forwarder.forward`; ``broker.core.forwarding`` says whether a
peer may do better and which. The request goes to that peer's brokers on
``topics.peer_asks`` (its origin is ours; the peer's broker makes it ``peer:<campus>``) and
waits, at most until the edge stops waiting, for the answer on ``topics.peer_answers``
(every replica hears each answer, ``broker.peers.Peers.hear``; the one that asked relays
it). A placement goes to the edge as the peer's broker signed it, named with the peer's
campus: the edge checks the token against the peer's keys in its own policy and sends the
image across itself. A refusal, a malformed answer or no answer in time answers the edge
with a refusal naming the peer, so the job runs on its edge. Each ask ends counted by peer
and outcome (``sluicegate_peer_asked_total``) and audited like any answer.

A placement relayed stays watched here (:class:`Abroad`) until its deadline: the peer's
notice that its worker was lost with the job (``topics.peer_notices``) is passed on to the
edge, which places the job again or runs it, and so is the loss of the bridge to the peer
(:meth:`Forwarder.link_lost`, from Mosquitto's word on the bridge), for every job out there
and every ask still waiting; a placement the edge hands back unused is handed back across
(``topics.peer_releases``) by the replica that relayed it. Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from broker.core.forwarding import forward_to
from broker.core.peering import PeerRefused, link_down
from broker.peers import Peers
from broker.reaper import tell_edge
from broker.waiting_room import Pending
from policies.model import Policy
from sluicegate import topics, wire
from sluicegate.errors import TransportError
from sluicegate.transport import Message, Transport
from sluicegate.wire_pool import JobNotice, PlacementRelease, PlacementReply

log = logging.getLogger(__name__)
ABROAD_S = 30.0  # how long a placement abroad without a deadline is watched
ABROAD_KEPT = 10_000  # the most watched at once (the oldest dropped first)


@dataclass(frozen=True, slots=True)
class Abroad:
    """A placement on a sister campus's worker relayed to one of our edges."""

    peer: str
    edge_id: str
    attempt: int
    worker: str  # as the peer names it
    until: float  # unix s: past its deadline nothing done for it helps


class Forwarder:
    """This replica's asks to sister campuses waiting for their answers."""

    def __init__(
        self,
        transport: Transport,
        policy: Callable[[], Policy | None],
        peers: Peers,
        clock: Callable[[], float],
        *,
        relay: Callable[[Pending, PlacementReply], None],
        refuse: Callable[[Pending, str, str], None],
        counted: Callable[[str, str], None] = lambda _peer, _outcome: None,
    ) -> None:
        self._transport = transport
        self._policy = policy
        self._peers = peers
        self._clock = clock
        self._relay = relay
        self._refuse = refuse
        self._counted = counted  # (peer, outcome): the service's counter
        self.abroad: dict[str, Abroad] = {}  # job id -> its placement relayed, watched
        self.notices: Counter[str] = Counter()  # "<peer>.<what>": passed on, unknown, ...
        self._waiting: dict[tuple[str, str], tuple[Pending, asyncio.TimerHandle]] = {}
        self.outcomes: Counter[str] = Counter()  # "<peer>.<outcome>"

    def forward(self, item: Pending, now: float) -> bool:
        """Ask a sister campus for ``item`` if one may do better than this campus; False
        leaves the request to the local answer."""
        policy = self._policy()
        peers = policy.peers_out() if policy is not None else ()
        if policy is None or not peers:
            return False
        choice = forward_to(
            policy,
            item.request,
            self._peers.offers,
            self._peers.standing,
            {peer: self._peers.link(peer) for peer in peers},
            now=now,
            waited_s=time.perf_counter() - item.arrived,
        )
        if isinstance(choice, PeerRefused):  # the local answer says why it stays
            return False
        request = item.request
        if policy.confidential(request.data_class):  # the peer must bind its worker's key
            request = request.model_copy(update={"sealed": True})
        topic = topics.peer_asks(policy.campus, choice.peer)
        try:  # QoS 0, as an edge's request: an ask is worth something only while the edge
            # waits; one held across a link cut would reserve a slot there for nothing
            self._transport.publish_nowait(Message(topic, wire.dump(request), qos=0))
        except TransportError as exc:
            log.warning("could not ask %s for job %s: %s", choice.peer, request.job_id, exc)
            return False
        key = (choice.peer, request.job_id)
        earlier = self._waiting.pop(key, None)
        if earlier is not None:  # the edge asked again for the same job: the newer ask wins
            earlier[1].cancel()
            self._end(choice.peer, "superseded")
        loop = asyncio.get_running_loop()
        timer = loop.call_later(max(0.0, choice.answer_by - now), self._timed_out, key)
        self._waiting[key] = (item, timer)
        return True

    def on_answer(self, msg: Message) -> None:
        """A peer's broker answers one of our asks."""
        peer = topics.peer_of(msg.topic)
        try:
            reply = PlacementReply.model_validate_json(msg.payload)
        except ValidationError as exc:
            log.warning("answer on %s unreadable: %s", msg.topic, exc)
            self._end(peer, "malformed")
            return
        waiting = self._waiting.pop((peer, reply.job_id), None)
        if waiting is None:  # another replica asked, or the edge stopped waiting
            return
        item, timer = waiting
        timer.cancel()
        if reply.status == "placed":
            self._end(peer, "placed")
            self._watch(item, peer, reply.worker_id or "?")
            self._relay(item, reply.model_copy(update={"campus": peer}))
        else:
            self._end(peer, "refused")
            why = f"sister campus {peer} refused it [{reply.code}]: {reply.reason}"
            self._refuse(item, "peer_refused", why)

    def _timed_out(self, key: tuple[str, str]) -> None:
        waiting = self._waiting.pop(key, None)
        if waiting is None:
            return
        peer = key[0]
        self._end(peer, "timeout")
        why = f"sister campus {peer} did not answer before the edge stops waiting"
        self._refuse(waiting[0], "peer_timeout", why)

    def _watch(self, item: Pending, peer: str, worker: str) -> None:
        request, now = item.request, self._clock()
        until = request.deadline_at if request.deadline_at is not None else now + ABROAD_S
        self.abroad.pop(request.job_id, None)  # the newest placement last in the order
        self.abroad[request.job_id] = Abroad(peer, request.edge_id, request.attempt, worker, until)
        while self.abroad:
            job_id, oldest = next(iter(self.abroad.items()))
            if oldest.until >= now and len(self.abroad) <= ABROAD_KEPT:
                break
            del self.abroad[job_id]

    def on_notice(self, msg: Message) -> None:
        """A sister campus says what became of a job our edge sent there: passed on to the
        edge if this replica relayed that very placement (else dropped, counted)."""
        peer, edge = topics.peer_of(msg.topic), topics.notices_edge(msg.topic)
        try:
            notice = JobNotice.model_validate_json(msg.payload)
        except ValidationError as exc:
            log.warning("notice on %s unreadable: %s", msg.topic, exc)
            self.notices[f"{peer}.malformed"] += 1
            return
        held = self.abroad.get(notice.job_id)
        if held is None or (held.peer, held.edge_id, held.attempt) != (
            peer,
            edge,
            notice.attempt,
        ):
            self.notices[f"{peer}.unknown"] += 1
            return
        del self.abroad[notice.job_id]
        self.notices[f"{peer}.{notice.kind}"] += 1
        worker = topics.peer_worker(notice.worker_id, peer)
        tell_edge(
            self._transport,
            topics.edge_notices(edge),
            notice.model_copy(update={"worker_id": worker}),
        )

    def link_lost(self, peer: str) -> None:
        """The bridge to ``peer`` is down: every job out there goes back to its edge as a
        lost worker's (placed again or run there; a late result is fenced by its attempt),
        and every ask still waiting for the peer's answer is refused now."""
        now = self._clock()
        down = link_down(peer)
        for job_id, held in list(self.abroad.items()):
            if held.peer != peer:
                continue
            del self.abroad[job_id]
            if held.until < now:
                continue
            self.notices[f"{peer}.link_lost"] += 1
            notice = JobNotice(
                job_id=job_id,
                attempt=held.attempt,
                kind="worker_lost",
                worker_id=topics.peer_worker(held.worker, peer),
                crashes=0,
                reason=down.reason,
            )
            tell_edge(self._transport, topics.edge_notices(held.edge_id), notice)
        for key in [k for k in self._waiting if k[0] == peer]:
            item, timer = self._waiting.pop(key)
            timer.cancel()
            self._end(peer, "link_lost")
            self._refuse(item, down.code, down.reason)

    def hand_back(self, rel: PlacementRelease) -> None:
        """Our edge will not use its placement on a sister campus's worker: handed back
        across by the replica that relayed it, so the peer frees the slot now."""
        held = self.abroad.get(rel.job_id)
        peer = topics.campus_of(rel.worker_id)
        policy = self._policy()
        if held is None or (held.peer, held.attempt) != (peer, rel.attempt) or policy is None:
            return
        del self.abroad[rel.job_id]
        across = rel.model_copy(update={"worker_id": topics.local_name(rel.worker_id)})
        topic = topics.peer_releases(policy.campus, peer)
        try:
            self._transport.publish_nowait(Message(topic, wire.dump(across), qos=1))
        except TransportError as exc:
            log.warning("could not hand back job %s's placement on %s: %s", rel.job_id, peer, exc)

    def _end(self, peer: str, outcome: str) -> None:
        self.outcomes[f"{peer}.{outcome}"] += 1
        self._counted(peer, outcome)
