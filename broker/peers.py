"""A broker replica's side of the agreements with sister campuses, on the MQTT bridge between
them (``sluicegate.mosquitto.bridge_lines``).

It publishes, for each peer the policy lists, this campus's signed half of the agreement
(the file ``<campus>.to-<peer>.agreement.json`` the officers signed beside the policy file;
retained, again every ``HALF_EVERY_S``) and, every interval, a summary of what the workers
in the zones the agreement opens can take, signed by this replica's key (retained; a
receiver keeps it ``ttl_s``). A peer dropped from the policy gets one last summary saying
no half is in force, so it stops sending within one interval, and the officers' signed
withdrawal (the same file, signed for the new version), if they made one. It hears each
peer's half and summaries on the peer's tree to this campus: what fails a check is counted
by reason and logged; the core (``policies.agreement``, ``broker.core.peering``) decides.
Each interval it also probes the link to each peer (one probe in ``PAD_EVERY`` padded, to
time throughput) and echoes the peer's probes. A peer broker's ask for a placement is taken
only while the agreement is in force and the peer within its ``receive`` limits, with the
peer as its origin (``peer:<campus>``), then decided, reserved, signed and answered by the
production path like an edge's request, the answer on the peer's ``answers`` topic; a
placement the peer's edge hands back is released here as an edge's is, and a notice of a
worker lost with a peer's job goes back across (:meth:`Peers.notify`). Mosquitto's word on
this campus's bridge to each peer (``topics.bridge_state``) makes the link unknown while the
bridge is down, and its going down calls ``link_lost``. Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from broker.core.fleet import Fleet
from broker.core.peering import (
    Link,
    LinkMeter,
    PeerLimits,
    PeerOffers,
    summary_of,
)
from broker.waiting_room import Pending
from policies.agreement import (
    PeerBook,
    Standing,
    Statement,
    own_half_problem,
    parse_statement,
)
from policies.errors import AgreementRefused, PolicyError
from policies.evaluate import peer_origin
from policies.keys import SigningKey
from policies.model import Policy
from sluicegate import topics, wire
from sluicegate.errors import TransportError, WireError
from sluicegate.transport import Message, Transport
from sluicegate.wire_peer import (
    Probe,
    parse_probe,
    parse_summary,
    sign_summary,
)
from sluicegate.wire_pool import JobNotice, PlacementRelease, PlacementReply, PlacementRequest

log = logging.getLogger(__name__)


def _bridge_state(peer: str, _us: str) -> str:
    return topics.bridge_state(peer)


HALF_EVERY_S = 30.0  # our half again, for a peer's replica that missed the retained copy
PAD_EVERY = 5  # one probe in five carries PAD_BYTES, to time the link's throughput
PAD_BYTES = 32 * 1024


def half_file(folder: Path, campus: str, peer: str) -> Path:
    """Where the officers' ``policy peer-sign`` writes a campus's half for ``peer``."""
    return folder / f"{campus}.to-{peer}.agreement.json"


class Peers:
    """This replica's agreements with sister campuses: halves held, summaries heard and sent."""

    def __init__(
        self,
        transport: Transport,
        policy: Callable[[], Policy | None],
        key: SigningKey,
        broker_id: str,
        fleet: Fleet,
        halves_dir: Path | None,
        clock: Callable[[], float],
        interval_s: float = 1.0,
        on_refused: Callable[[str, str], None] = lambda _kind, _reason: None,
        place: Callable[[Pending], None] | None = None,
        refuse: Callable[[Pending, str, str], None] | None = None,
        release: Callable[[PlacementRelease], None] | None = None,
        link_lost: Callable[[str], None] = lambda _peer: None,
    ) -> None:
        self._transport = transport
        self._policy = policy
        self._key = key
        self._broker_id = broker_id
        self._fleet = fleet
        self._halves_dir = halves_dir
        self._clock = clock
        self.interval_s = interval_s
        self._on_refused = on_refused  # (kind, reason): a counter, in the service
        # A peer's ask goes to the production placement path (the service's inbox), or is
        # refused there (answered and audited like an edge's); without them, never taken.
        self._place = place
        self._refuse = refuse
        self._release = release  # a peer's edge hands back a placement here (the Reaper's)
        self._link_lost = link_lost  # this campus's bridge to the peer went down
        self.bridge_down: set[str] = set()  # peers whose bridge Mosquitto says is down
        self.limits = PeerLimits()
        self.book = PeerBook()
        self.offers = PeerOffers()
        self.refused: Counter[str] = Counter()  # "<kind>.<reason>": halves, summaries, asks
        self.sent = 0  # summaries published
        self._seq = int(clock() * 1000)  # increasing across restarts of this replica
        self._listening: set[tuple[int, str]] = set()  # (what, peer) subscribed
        self._hearing: list[tuple[Callable[[str, str], str], Callable[[Message], None], bool]] = []
        self._offered: set[str] = set()  # peers last offered anything
        self._half_sent_at: dict[str, float] = {}
        self._half_warned: set[str] = set()
        # Our halves as last read: peer -> ((policy digest, file mtime, size), half or None).
        self._own: dict[str, tuple[tuple[bytes, int, int], Statement | None]] = {}
        self.meters: dict[str, LinkMeter] = {}
        self._probes = 0

    # -- hearing -----------------------------------------------------------------------------

    def hear(
        self,
        topic: Callable[[str, str], str],
        handler: Callable[[Message], None],
        *,
        sending_only: bool = False,
    ) -> None:
        """Also subscribe ``handler`` to ``topic(peer, this campus)`` of each listed peer
        (only those this campus may send to, with ``sending_only``), as :meth:`listen`
        finds them: the asks' answers, the usage records."""
        self._hearing.append((topic, handler, sending_only))

    async def listen(self) -> None:
        """Subscribe to what each listed peer says to this campus (once each): its half,
        summaries and probes on every replica, its asks shared among the replicas (each
        ask decided, reserved and answered once), and what :meth:`hear` added."""
        policy = self._policy()
        if policy is None:
            return
        us = policy.campus
        mine = (
            (topics.peer_agreement, self.on_message, False),
            (topics.peer_summary, self.on_message, False),
            (topics.peer_probe, self.on_message, False),
            (topics.peer_asks_shared, self.on_message, False),
            (topics.peer_releases, self.on_message, False),
            (_bridge_state, self.on_message, False),
        )
        sending = set(policy.peers_out())
        for n, (topic, handler, sending_only) in enumerate((*mine, *self._hearing)):
            for peer in sorted(policy.peers):
                if (n, peer) in self._listening or (sending_only and peer not in sending):
                    continue
                await self._transport.subscribe(topic(peer, us), handler)
                self._listening.add((n, peer))

    def on_message(self, msg: Message) -> None:
        policy = self._policy()
        if policy is None or not msg.payload:
            return
        if msg.topic.endswith("/agreement"):
            self._hear_half(policy, msg)
        elif msg.topic.endswith("/summary"):
            self._hear_summary(policy, msg)
        elif msg.topic.endswith("/probe"):
            self._hear_probe(policy, msg)
        elif msg.topic.endswith("/asks"):
            self._hear_ask(policy, msg)
        elif msg.topic.endswith("/releases"):
            self._hear_release(policy, msg)
        elif msg.topic.endswith("/state"):
            self._hear_bridge(policy, msg)

    def _hear_ask(self, policy: Policy, msg: Message) -> None:
        """A peer's broker asks for a placement: its origin is the peer (the bridge wrote
        the topic), the agreement must be in force and the peer within its limits; then
        the production path decides, inside this campus's policy, and answers the peer."""
        peer = topics.peer_of(msg.topic)
        answers = topics.peer_answers(policy.campus, peer)
        if peer not in policy.peers or self._place is None or self._refuse is None:
            return
        try:
            request = PlacementRequest.model_validate_json(msg.payload)
        except ValidationError as exc:
            self._malformed("ask", msg.topic, exc)
            bad = PlacementReply(
                job_id="?", status="refused", code="bad_request", reason=f"{exc}"[:500]
            )
            self._transport.publish_nowait(Message(answers, wire.dump(bad), qos=0))
            return
        request = request.model_copy(update={"origin_zone": peer_origin(peer)})
        item = Pending(request, answers, None, time.perf_counter())
        standing = self.standing(peer)
        if not standing.in_force:
            self._count("ask", "no_agreement")
            self._refuse(item, "no_agreement", standing.reason)
            return
        limited = self.limits.admit(policy, peer, request.payload_bytes, self._clock())
        if limited is not None:
            self._count("ask", limited.code)
            self._refuse(item, limited.code, limited.reason)
            return
        self._place(item)

    def _hear_release(self, policy: Policy, msg: Message) -> None:
        """A peer's broker hands back a placement here its edge will not use: released as
        an edge of ours would release it, the edge named as the peer's (the record's)."""
        peer = topics.peer_of(msg.topic)
        if peer not in policy.peers or self._release is None:
            return
        try:
            rel = PlacementRelease.model_validate_json(msg.payload)
        except ValidationError as exc:
            self._malformed("release", msg.topic, exc)
            return
        self._release(rel.model_copy(update={"edge_id": topics.peer_edge(rel.edge_id, peer)}))

    def _hear_bridge(self, policy: Policy, msg: Message) -> None:
        """Mosquitto says whether this campus's bridge to a peer is up: while it is down the
        link is not known (no ask goes there), and the moment it goes down the jobs out
        there are placed again (``link_lost``)."""
        peer = topics.bridge_peer(msg.topic)
        if peer not in policy.peers:
            return
        if msg.payload.strip() != b"0":
            if peer in self.bridge_down:
                log.info("the bridge to %s is up again", peer)
            self.bridge_down.discard(peer)
            return
        if peer not in self.bridge_down:
            self.bridge_down.add(peer)
            log.warning("the bridge to %s is down: no ask goes there until it is back", peer)
            self._link_lost(peer)

    def notify(self, campus: str, edge: str, notice: JobNotice) -> None:
        """Tell sister campus ``campus`` what became of the job its edge ``edge`` sent here
        (its worker was lost): its broker passes it on to the edge."""
        policy = self._policy()
        if policy is None:
            return
        topic = topics.peer_notices(policy.campus, campus, edge)
        try:
            self._transport.publish_nowait(Message(topic, wire.dump(notice), qos=1))
        except TransportError as exc:
            log.warning("job %s: notice to %s not sent: %s", notice.job_id, campus, exc)

    def _hear_probe(self, policy: Policy, msg: Message) -> None:
        peer = topics.peer_of(msg.topic)
        if peer not in policy.peers:
            return
        try:
            probe = parse_probe(msg.payload)
        except WireError as exc:
            self._malformed("probe", msg.topic, exc)
            return
        if probe.kind == "echo":
            self.meters.setdefault(peer, LinkMeter()).echoed(probe.nonce, self._clock())
            return
        echo = Probe(kind="echo", broker=self._broker_id, nonce=probe.nonce, sent_at=probe.sent_at)
        topic = topics.peer_probe(policy.campus, peer)
        self._transport.publish_nowait(Message(topic, echo.model_dump_json().encode(), qos=0))

    def facts(self) -> dict[str, tuple[bool, int, float | None]]:
        """Per listed peer, from :meth:`describe`: agreement in force, free slots its fresh
        summary offers, the link's round trip (None: not known). For the metrics."""
        return {
            p["peer"]: (
                p["standing"] == "in_force",
                sum(o["free_slots"] for o in p["offers"]),
                p["link"]["rtt_s"] if p["link"] is not None else None,
            )
            for p in self.describe()["peers"]
        }

    def describe(self) -> dict[str, Any]:
        """Each listed peer for people: standing and why, its half's version, its fresh
        offers, the link, and what was refused (halves and summaries by reason)."""
        policy = self._policy()
        peers = sorted(policy.peers) if policy is not None else []
        now = self._clock()
        out: list[dict[str, Any]] = []
        for peer in peers:
            standing = self.standing(peer)
            body = self.offers.fresh(peer, now=now)
            link = self.link(peer)
            out.append(
                {
                    "peer": peer,
                    "standing": standing.code,
                    "reason": standing.reason,
                    "half_version": standing.version,
                    "summary_at": body.at if body is not None else None,
                    "offers": [o.model_dump() for o in body.offers] if body is not None else [],
                    "link": {"rtt_s": link.rtt_s, "bytes_per_s": link.bytes_per_s}
                    if link is not None
                    else None,
                    "bridge": "down" if peer in self.bridge_down else "up",
                }
            )
        return {"peers": out, "refused": dict(sorted(self.refused.items()))}

    def link(self, peer: str) -> Link | None:
        """The link to ``peer`` as the probes measured it (None: not known, stale, or the
        bridge down)."""
        meter = self.meters.get(peer)
        if peer in self.bridge_down:
            return None
        return meter.link(self._clock()) if meter is not None else None

    def _hear_half(self, policy: Policy, msg: Message) -> None:
        try:
            statement = parse_statement(msg.payload, source=msg.topic)
            if self.book.offer(policy, statement):
                standing = self.standing(statement.campus)
                log.info("agreement with %s: %s", statement.campus, standing.reason)
        except AgreementRefused as exc:
            self._count("half", exc.reason)
            log.warning("half on %s refused [%s]: %s", msg.topic, exc.reason, exc)
        except PolicyError as exc:
            self._malformed("half", msg.topic, exc)

    def _count(self, kind: str, reason: str) -> None:
        """A refused message from a peer: counted here (``describe``) and by the hook."""
        self.refused[f"{kind}.{reason}"] += 1
        self._on_refused(kind, reason)

    def _malformed(self, kind: str, topic: str, exc: Exception) -> None:
        self._count(kind, "malformed")
        log.warning("%s on %s unreadable: %s", kind, topic, exc)

    def _hear_summary(self, policy: Policy, msg: Message) -> None:
        try:
            signed = parse_summary(msg.payload)
        except WireError as exc:
            self._malformed("summary", msg.topic, exc)
            return
        refusal = self.offers.hear(policy, signed, now=self._clock())
        if refusal is not None:
            self._count("summary", refusal.code)
            log.warning("summary on %s refused [%s]: %s", msg.topic, refusal.code, refusal.reason)

    def standing(self, peer: str) -> Standing:
        policy = self._policy()
        if policy is None:
            return Standing(peer, "not_listed", "no policy in force")
        return self.book.judge(policy, peer, now=self._clock())

    # -- speaking ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Listen, then every interval: halves when due, a summary to each peer."""
        while True:
            try:
                await self.listen()
                self.tick()
            except TransportError as exc:
                log.warning("sister campuses: %s", exc)
            await asyncio.sleep(self.interval_s)

    def tick(self) -> None:
        """Publish what is due now: halves, then summaries."""
        policy = self._policy()
        if policy is None:
            return
        now = self._clock()
        dropped = self._offered - set(policy.peers)
        for peer in sorted(set(policy.peers) | dropped):
            # A dropped peer's half once, now: the officers' signed withdrawal, if any.
            if peer in dropped or now - self._half_sent_at.get(peer, -1e18) >= HALF_EVERY_S:
                self._publish_half(policy, peer, now)
        for peer in sorted(set(policy.peers) | self._offered):
            self._publish_summary(policy, peer, now)
        self._offered = set(policy.peers)
        self._probes += 1
        pad = PAD_BYTES if self._probes % PAD_EVERY == 0 else 0
        for peer in sorted(policy.peers):
            self._probe(policy, peer, now, pad)

    def _probe(self, policy: Policy, peer: str, now: float, pad: int) -> None:
        nonce = secrets.token_hex(16)
        probe = Probe(kind="probe", broker=self._broker_id, nonce=nonce, sent_at=now, pad="0" * pad)
        self.meters.setdefault(peer, LinkMeter()).sent(nonce, now, pad)
        topic = topics.peer_probe(policy.campus, peer)
        self._transport.publish_nowait(Message(topic, probe.model_dump_json().encode(), qos=0))

    def own_half(self, policy: Policy, peer: str) -> Statement | None:
        """Our signed half for ``peer`` as the officers left it, if it is publishable. Read
        and checked again only when the file or the policy changed (it is asked for every
        interval)."""
        if self._halves_dir is None:
            return None
        path = half_file(self._halves_dir, policy.campus, peer)
        try:
            info = path.stat()
        except OSError as exc:
            self._warn_once(peer, f"no half for {peer!r} to publish ({path}): {exc}")
            return None
        stamp = (policy.digest, info.st_mtime_ns, info.st_size)
        held = self._own.get(peer)
        if held is not None and held[0] == stamp:
            return held[1]
        statement: Statement | None = None
        try:
            statement = parse_statement(path.read_bytes(), source=str(path))
            problem = own_half_problem(policy, statement)
        except (OSError, PolicyError) as exc:
            problem = f"unreadable: {exc}"
        if problem is not None:
            statement = None
            self._warn_once(peer, f"{path} not published: {problem}")
        else:
            self._half_warned.discard(peer)
        self._own[peer] = (stamp, statement)
        return statement

    def _warn_once(self, peer: str, text: str) -> None:
        if peer not in self._half_warned:
            self._half_warned.add(peer)
            log.warning(text)

    def _publish_half(self, policy: Policy, peer: str, now: float) -> None:
        statement = self.own_half(policy, peer)
        if statement is None:
            return
        topic = topics.peer_agreement(policy.campus, peer)
        self._transport.publish_nowait(Message(topic, statement.to_bytes(), qos=1, retain=True))
        self._half_sent_at[peer] = now

    def _publish_summary(self, policy: Policy, peer: str, now: float) -> None:
        half = self.own_half(policy, peer) if peer in policy.peers else None
        self._seq += 1
        body = summary_of(
            policy,
            peer,
            self._fleet,
            half.version if half is not None else None,
            broker=self._broker_id,
            seq=self._seq,
            at=now,
            interval_s=self.interval_s,
        )
        payload = sign_summary(body, self._key)
        topic = topics.peer_summary(policy.campus, peer)
        self._transport.publish_nowait(Message(topic, payload, qos=1, retain=True))
        self.sent += 1
