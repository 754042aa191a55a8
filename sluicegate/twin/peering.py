"""Sister campuses in a replay: the peers a change names, each its own broker and workers
behind a link, decided with the production code on both sides of the agreement.

Each :class:`SimPeer` holds the sister campus's policy, its own
:class:`~broker.core.fleet.Fleet` fed by its simulated workers (the replay's
:class:`~sluicegate.twin.nodes.SimWorker`, batching as a worker does), the production
``PeerLimits`` that hold it to its ``receive`` limits, and the link. :class:`Sisters` is
the replay's side of the agreements:

* whether each agreement is in force, both ways, is ``policies.agreement.judge`` on the two
  policies' halves (the twin takes each half as signed: it rehearses before the officers
  sign), so terms that do not mirror each other say why and nothing is sent;
* every summary interval each peer's broker makes its summary with
  ``broker.core.peering.summary_of`` from its fleet, which reaches this campus half a round
  trip later and is kept as the broker keeps a verified one;
* which peer to ask, and until when its answer is worth waiting for, is
  ``broker.core.forwarding.forward_to`` (the broker's ``decide_turn`` offers it exactly the
  jobs it offers a peer in production); the peer takes the ask as its broker does: in
  force on its side, within its limits, then its own ``decide_turn`` and ``settle`` under
  its policy with this campus as the origin (``peer:<campus>``).

A peer's own load is not replayed: its workers serve this campus's jobs only, so give a
peer the workers it would lend. Times: the ask and its answer cross the link once each
way; an image takes the campus's own leg (as to a worker in the edge's zone), half the
round trip and its bytes at the link's throughput; a result half the round trip back.

A link cut (``cuts``: the peer, when, for how long) is what the broker sees when Mosquitto
says its bridge is down: no ask goes there (the link is not known), an ask or answer that
would cross is refused (``peer_link_lost``), and the jobs out there go back to their edges
as a lost worker's (the replay's :meth:`~sluicegate.twin.events.Events.lose_link`). What
was on its way across (an image, a result) crosses when the link is back, as the bridge's
session holds it: a late result is fenced by the edge's attempt.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from broker.core.batch import decide_turn, settle
from broker.core.fleet import Fleet
from broker.core.forwarding import RESULT_BYTES, Forward, forward_to
from broker.core.params import FleetParams
from broker.core.peering import (
    Link,
    PeerLimits,
    PeerOffers,
    PeerRefused,
    link_down,
    summary_of,
)
from policies.agreement import Standing, judge, statement_for
from policies.evaluate import allowed, peer_origin
from policies.model import Policy
from sluicegate import topics
from sluicegate.twin.nodes import PeerSpec, SimWorker, unsealed
from sluicegate.wire_peer import SummaryBody
from sluicegate.wire_pool import PlacementRequest

SUMMARY_INTERVAL_S = 1.0  # a broker's summaries, at most its telemetry interval apart


@dataclass(frozen=True, slots=True)
class PeerPlaced:
    """A peer's worker reserved for the job: its name here (``<worker>@<campus>``)."""

    worker: str
    zone: str
    predicted_ms: float


class SimPeer:
    """One sister campus: its policy, its broker's fleet and limits, its workers, the link."""

    def __init__(self, spec: PeerSpec, interval_s: float) -> None:
        self.spec = spec
        self.campus = spec.campus
        self.policy = spec.policy
        self.fleet = Fleet(FleetParams(forecast_horizon_s=3.0 * interval_s), None, spec.policy)
        self.workers = {
            topics.peer_worker(w.id, self.campus): SimWorker(w, 1.0, self.campus)
            for w in spec.workers
        }
        self.limits = PeerLimits()
        self.link = Link(spec.rtt_s, spec.bytes_per_s)
        self.seq = 0

    def half_version(self, ours: str) -> int | None:
        """The version of its half for ``ours`` (None: its policy does not list us)."""
        return self.policy.version if ours in self.policy.peers else None


class Sisters:
    """The sister campuses of one replay, as this campus's broker and theirs see them."""

    def __init__(
        self,
        specs: tuple[PeerSpec, ...],
        ours: Policy,
        interval_s: float,
        at: Callable[..., None],
        live: Callable[[], bool],
        *,
        t0: float,
        cuts: tuple[tuple[str, float, float], ...] = (),
    ) -> None:
        """``t0``: when the replay starts (whether the halves are in force is judged then);
        ``cuts``: (peer, s after ``t0``, s down) the link is cut."""
        self.ours = ours
        self.cuts: dict[str, list[tuple[float, float]]] = {}  # peer: (start, end) each
        for campus, at_s, down in cuts:
            self.cuts.setdefault(campus, []).append((t0 + at_s, t0 + at_s + down))
        self.peers = {s.campus: SimPeer(s, interval_s) for s in specs}
        self.offers = PeerOffers()
        self.summary_s = min(interval_s, SUMMARY_INTERVAL_S)
        self.at = at
        self._live = live
        self.counts: dict[str, Counter[str]] = {p: Counter() for p in self.peers}
        self.warnings = tuple(self._warnings(t0))

    def _warnings(self, now: float) -> list[str]:
        out = []
        for campus, peer in self.peers.items():
            if campus not in self.ours.peers:
                continue  # withdrawn or never agreed: nothing goes there, by design
            for why in (
                judge(self.ours, campus, statement_for(peer.policy, self.ours.campus), now=now),
                judge(peer.policy, self.ours.campus, statement_for(self.ours, campus), now=now),
            ):
                if not why.in_force:
                    out.append(f"agreement with {campus}: {why.reason}")
            for w in peer.workers.values():
                zone = peer.policy.worker_zone(w.spec.id)
                if zone is None or zone not in self.ours.peers[campus].send.zones:
                    out.append(
                        f"{w.spec.id} of {campus} is in no zone its agreement with "
                        f"{self.ours.campus} opens: nothing is placed there"
                    )
        return out

    def down(self, campus: str, when: float) -> tuple[float, float] | None:
        """The cut under way on the link to ``campus`` at ``when`` (start, end), if any."""
        for start, end in self.cuts.get(campus, ()):
            if start <= when < end:
                return start, end
        return None

    def crossing(self, campus: str, when: float) -> float:
        """When a message due across the link to ``campus`` at ``when`` arrives: then, or as
        the link comes back (the bridge's session held it)."""
        cut = self.down(campus, when)
        return when if cut is None else cut[1]

    def worker(self, name: str) -> SimWorker | None:
        peer = self.peers.get(topics.campus_of(name))
        return peer.workers.get(name) if peer is not None else None

    def fleet_of(self, name: str) -> Fleet:
        return self.peers[topics.campus_of(name)].fleet

    # -- the clock's ticks ------------------------------------------------------------------

    def start(self, now: float) -> None:
        for peer in self.peers.values():
            for w in peer.workers.values():
                peer.fleet.apply_capabilities(w.capabilities(), now)
        self._summaries(now)

    def telemetry(self, now: float, interval_s: float) -> None:
        """Every telemetry interval: each peer worker's telemetry to its broker's fleet."""
        for peer in self.peers.values():
            for w in peer.workers.values():
                if w.alive:
                    peer.fleet.apply_telemetry(w.telemetry(now, interval_s), now)

    def _summaries(self, now: float) -> None:
        """Each peer's summary to this campus, kept here half a round trip later."""
        for campus, peer in self.peers.items():
            if self.down(campus, now) is not None:
                continue  # nothing crosses: its last summary goes stale here
            peer.seq += 1
            body = summary_of(
                peer.policy,
                self.ours.campus,
                peer.fleet,
                peer.half_version(self.ours.campus),
                broker=f"{campus}-broker",
                seq=peer.seq,
                at=now,
                interval_s=self.summary_s,
            )
            self.at(now + peer.link.rtt_s / 2.0, _keep, self.offers, body)
        if self._live():
            self.at(now + self.summary_s, self._summaries)

    # -- this campus's broker ----------------------------------------------------------------

    def standing(self, campus: str, now: float) -> Standing:
        """The agreement as this campus holds it: our entry against their half."""
        theirs = statement_for(self.peers[campus].policy, self.ours.campus)
        return judge(self.ours, campus, theirs, now=now)

    def forward(
        self,
        request: PlacementRequest,
        now: float,
        waited_s: float,
        then: Callable[[float, PeerPlaced | PeerRefused], None],
    ) -> bool:
        """Ask the peer the broker's forwarder would ask for ``request``, if any (False:
        none may do better). The ask crosses the link, the peer decides, its answer
        crosses back: ``then(now, answer)`` once it is here, the answer ``peer_refused``
        or, past the moment the edge stops waiting, ``peer_timeout``, as the forwarder
        relays them."""
        choice = self._choose(request, now, waited_s)
        if choice is None:
            return False
        half = self.peers[choice.peer].link.rtt_s / 2.0
        if self.down(choice.peer, now + half) is not None:  # the bridge falls as it crosses
            self.at(now + half, self._lost_on_the_way, choice.peer, then)
            return True
        self.at(now + half, self._at_peer, choice, request, half, then)
        return True

    def _at_peer(
        self,
        now: float,
        choice: Forward,
        request: PlacementRequest,
        half: float,
        then: Callable[[float, PeerPlaced | PeerRefused], None],
    ) -> None:
        answer = self.ask(choice.peer, request, now)
        if self.down(choice.peer, now + half) is not None:  # the peer's reservation stays
            self.at(now + half, self._lost_on_the_way, choice.peer, then)
            return
        self.at(now + half, self._answered, choice, answer, then)

    def _lost_on_the_way(
        self, now: float, peer: str, then: Callable[[float, PeerPlaced | PeerRefused], None]
    ) -> None:
        """The bridge went down with the ask or its answer on it: refused, as the forwarder
        refuses the asks waiting when Mosquitto says so."""
        self.counts[peer]["link lost"] += 1
        then(now, link_down(peer))

    def _answered(
        self,
        now: float,
        choice: Forward,
        answer: PeerPlaced | PeerRefused,
        then: Callable[[float, PeerPlaced | PeerRefused], None],
    ) -> None:
        peer = choice.peer
        if now > choice.answer_by:  # the peer's reservation stays, as it does
            self.counts[peer]["timeout"] += 1
            why = f"sister campus {peer} did not answer before the edge stops waiting"
            answer = PeerRefused("peer_timeout", why)
        elif isinstance(answer, PeerRefused):
            why = f"sister campus {peer} refused it [{answer.code}]: {answer.reason}"
            answer = PeerRefused("peer_refused", why)
        then(now, answer)

    def _choose(self, request: PlacementRequest, now: float, waited_s: float) -> Forward | None:
        """The peer to ask, as the broker's forwarder chooses (None: none may do better)."""
        if not self.peers:
            return None
        standing = {p: self.standing(p, now) for p in self.peers}
        choice = forward_to(
            self.ours,
            request,
            self.offers,
            lambda p: standing.get(p) or Standing(p, "no_statement", f"no --peer for {p}"),
            {  # while the bridge is down the link is not known
                p: peer.link if self.down(p, now) is None else None
                for p, peer in self.peers.items()
            },
            now=now,
            waited_s=waited_s,
        )
        if isinstance(choice, PeerRefused):
            return None
        self.counts[choice.peer]["asked"] += 1
        return choice

    # -- the peer's broker -------------------------------------------------------------------

    def ask(self, campus: str, request: PlacementRequest, now: float) -> PeerPlaced | PeerRefused:
        """A peer's broker takes our ask: in force on its side, within its limits, then its
        own placement turn under its policy, with this campus as the origin."""
        peer, ours = self.peers[campus], self.ours.campus
        theirs = judge(peer.policy, ours, statement_for(self.ours, campus), now=now)
        refusal: PeerRefused | None = None
        if not theirs.in_force:
            refusal = PeerRefused("no_agreement", theirs.reason)
        else:
            refusal = peer.limits.admit(peer.policy, ours, request.payload_bytes, now)
        if refusal is None:
            asked = request.model_copy(
                update={
                    "origin_zone": peer_origin(ours),
                    "sealed": self.ours.confidential(request.data_class),
                }
            )
            turn = decide_turn(
                peer.fleet,
                (asked,),
                _itself,
                peer.policy,
                now=now,
                params=peer.spec.params,
                hold=_no_room,
                sealable=unsealed,
            )
            settled = settle(peer.fleet, turn.placed, [True] * len(turn.placed), _itself, now=now)
            for _item, placed in settled.granted:
                self.counts[campus]["placed"] += 1
                name = topics.peer_worker(placed.worker_id, campus)
                return PeerPlaced(name, placed.zone, placed.predicted_ms)
            first = (*turn.refused, *settled.refused)[0]
            refusal = PeerRefused(first.code, first.reason)
        self.counts[campus][f"refused {refusal.code}"] += 1
        return refusal

    def broke_agreement(self, data_class: str, worker: str) -> bool:
        """Whether a job of ``data_class`` on the peer worker ``worker`` breaks either
        side's terms (the forwarder and the peer's decision never should)."""
        campus = topics.campus_of(worker)
        peer, entry = self.peers[campus], self.ours.peers.get(campus)
        zone = peer.policy.worker_zone(peer.workers[worker].spec.id) or ""
        if entry is None or data_class not in entry.send.classes:
            return True
        return not allowed(peer.policy, data_class, peer_origin(self.ours.campus), zone).allowed

    def sent(self, worker: str, payload_bytes: int) -> tuple[float, float]:
        """An image on its way to a peer's ``worker``: the link's part of the way there and
        of the way back (s)."""
        peer = self.peers[topics.campus_of(worker)]
        self.counts[peer.campus]["images sent"] += 1
        link = peer.link
        half = link.rtt_s / 2.0
        return half + payload_bytes / link.bytes_per_s, half + RESULT_BYTES / link.bytes_per_s

    def result(self) -> dict[str, dict[str, int]]:
        return {p: dict(sorted(c.items())) for p, c in sorted(self.counts.items())}


def undescribed(ours: Policy, specs: tuple[PeerSpec, ...]) -> list[str]:
    """The sister campuses ``ours`` may send to that no spec describes: nothing goes there."""
    described = {s.campus for s in specs}
    return [
        f"policy lists sister campus {campus} but no --peer describes it"
        for campus in ours.peers_out()
        if campus not in described
    ]


def _keep(now: float, offers: PeerOffers, body: SummaryBody) -> None:
    offers.keep(body)


def _itself(request: PlacementRequest) -> PlacementRequest:
    return request


def _no_room(_request: PlacementRequest, _now: float) -> bool:
    """A peer's broker holds no ask in its waiting room in the twin: refused at once."""
    return False
