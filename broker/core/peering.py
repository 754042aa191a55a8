"""Sister campuses in the decision: what this campus offers a peer (its summary), what a
peer offers this one (the summaries it keeps), and when a peer's pool is a candidate.

Offering: :func:`capacities_of` reads the fleet's workers in the zones an agreement opens,
and :func:`offers_of` turns their free slots, queue and service times per model
and device class into ``wire_peer.Offer`` values at three CATS levels: L0 the raw figures,
L1 each category in [0, 1] with 1 the best (capacity: free slots over slots; delay: how
much of a reference deadline the queue and service leave; cost: the price against a
reference price), L2 one score (their weighted mean, 0 with no free slot).

Hearing: :class:`PeerOffers` keeps the newest fresh summary from each peer. A summary is
refused, counted by reason and never kept, when it is not addressed to this campus or comes
from a campus the policy does not list (``wrong_parties``), is signed by a replica the
entry does not pin (``unknown_broker``) or does not verify (``bad_signature``), is not
newer than the last from that replica (``replayed``), or is stale or dated too far ahead
(``stale``, ``from_the_future``). A kept summary makes the peer's pool a candidate only
while it is fresh, the agreement is in force, the sender says the same half is in force on
its side, the job's class may be sent there, and the offer has a free slot.

A candidate's predicted completion (:func:`remote_completion_s`) is the link time for the
image there and the result back plus the peer's own estimate (queue p50 and service), the
link as :class:`LinkMeter` measured it from probes.
Pure: the clock is passed in; refusals are values, never exceptions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

from broker.core.fleet import Fleet
from policies.agreement import Standing
from policies.model import Policy
from sluicegate.wire_peer import Offer, SignedSummary, SummaryBody

# L1 references: a queue and service that use all of DELAY_REF_MS score 0 on delay; a price
# of PRICE_REF a device-second scores 0 on cost. L2 weights: capacity, delay, cost.
DELAY_REF_MS = 1000.0
PRICE_REF = 0.01
WEIGHTS = (0.4, 0.4, 0.2)
MAX_AHEAD_S = 5.0  # a summary dated further ahead than this is from a wrong clock


@dataclass(frozen=True, slots=True)
class Capacity:
    """What this campus's pool has for one model on one device class, right now."""

    model: str
    device_class: str
    free_slots: int
    slots: int
    queue_p50_ms: float
    queue_p99_ms: float
    service_ms: float


def capacities_of(fleet: Fleet, zones: Collection[str]) -> list[Capacity]:
    """What the fleet's workers in ``zones`` (their zones as the policy says) have now, per
    model and device class: free slots and slots summed, the shortest and longest work
    ahead among them as queue p50 and p99, the mean of their service times (as each reports
    it, else as the fleet estimates it)."""
    policy = fleet.policy
    groups: dict[tuple[str, str], list[tuple[int, int, float, float]]] = {}
    for state in fleet.states():
        caps, latest = state.capabilities, state.latest
        if caps is None or latest is None or not state.online:
            continue
        if policy is None or policy.worker_zone(state.worker_id) not in zones:
            continue
        free = fleet.headroom(state.worker_id)
        backlog = latest.backlog_ms or 0.0
        for model in caps.models:
            if "@" in model:  # a version kept beside the current one: offered by its name
                continue
            # What it reports, else the fleet's estimate (a worker that has run nothing yet
            # still offers its slots, at the time placement itself would predict).
            service = latest.service_ms.get(model) or fleet.service.estimate(
                model, caps.device_class
            )
            groups.setdefault((model, caps.device_class), []).append(
                (free, latest.capacity, backlog, service)
            )
    out = []
    for (model, device_class), rows in sorted(groups.items()):
        backlogs = sorted(b for _f, _c, b, _s in rows)
        out.append(
            Capacity(
                model,
                device_class,
                free_slots=sum(f for f, _c, _b, _s in rows),
                slots=sum(c for _f, c, _b, _s in rows),
                queue_p50_ms=backlogs[0],
                queue_p99_ms=backlogs[-1],
                service_ms=sum(s for _f, _c, _b, s in rows) / len(rows),
            )
        )
    return out


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value))


def offers_of(capacities: list[Capacity], device_second: float) -> tuple[Offer, ...]:
    """The offers of a summary, at the price the agreement sets, in a fixed order."""
    cost = _unit(1.0 - device_second / PRICE_REF)
    out = []
    for c in sorted(capacities, key=lambda c: (c.model, c.device_class)):
        capacity = _unit(c.free_slots / c.slots) if c.slots > 0 else 0.0
        delay = _unit(1.0 - (c.queue_p50_ms + c.service_ms) / DELAY_REF_MS)
        score = 0.0
        if c.free_slots > 0:
            score = _unit(WEIGHTS[0] * capacity + WEIGHTS[1] * delay + WEIGHTS[2] * cost)
        out.append(
            Offer(
                model=c.model,
                device_class=c.device_class,
                free_slots=c.free_slots,
                queue_p50_ms=c.queue_p50_ms,
                queue_p99_ms=max(c.queue_p99_ms, c.queue_p50_ms),
                service_ms=max(c.service_ms, 1e-3),
                capacity=round(capacity, 4),
                delay=round(delay, 4),
                cost=round(cost, 4),
                score=round(score, 4),
            )
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PeerRefused:
    """Why a peer's summary was not kept, its pool is no candidate, or its job not taken."""

    code: str
    reason: str


def link_down(peer: str) -> PeerRefused:
    """What an ask across the bridge to ``peer`` gets while Mosquitto says it is down; its
    reason is also why the jobs out there go back to their edges."""
    return PeerRefused("peer_link_lost", f"the bridge to sister campus {peer} is down")


@dataclass
class Bucket:
    """A token bucket: ``rate`` a second, up to one second's worth held."""

    rate: float
    tokens: float
    at: float

    def take(self, amount: float, now: float) -> bool:
        self.tokens = min(self.rate, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if amount > self.tokens:
            return False
        self.tokens -= amount
        return True


@dataclass
class PeerLimits:
    """What each peer may still send this campus: the agreement's ``receive`` limits (jobs
    and bytes a second) as token buckets holding one second's worth. A job refused here is
    the peer's to place elsewhere or run at home; the refusal says which limit."""

    jobs: dict[str, Bucket] = field(default_factory=dict)
    volume: dict[str, Bucket] = field(default_factory=dict)

    def admit(self, ours: Policy, peer: str, payload_bytes: int, now: float) -> PeerRefused | None:
        entry = ours.peers.get(peer)
        if entry is None:
            return PeerRefused("no_agreement", f"policy v{ours.version} does not list {peer!r}")
        terms = entry.receive
        jobs = _bucket(self.jobs, peer, terms.max_jobs_per_s, now)
        volume = _bucket(self.volume, peer, terms.max_bytes_per_s, now)
        if not jobs.take(0.0, now) or jobs.tokens < 1.0:
            return PeerRefused(
                "peer_rate_limit", f"{peer!r} may send {terms.max_jobs_per_s:g} jobs/s here"
            )
        if not volume.take(payload_bytes, now):
            return PeerRefused(
                "peer_bytes_limit", f"{peer!r} may send {terms.max_bytes_per_s:g} bytes/s here"
            )
        jobs.take(1.0, now)
        return None


TTL_INTERVALS = 3.0  # a summary is valid three of its sender's intervals


def summary_of(
    ours: Policy,
    peer: str,
    fleet: Fleet,
    half_version: int | None,
    *,
    broker: str,
    seq: int,
    at: float,
    interval_s: float,
) -> SummaryBody:
    """What replica ``broker`` tells ``peer`` this campus offers now (unsigned): the offers
    of the workers in the zones the agreement opens, at its price, while ``half_version``
    of our half is in force (None: none is; then no offer, and version 0 says so)."""
    entry = ours.peers.get(peer)
    offers: tuple[Offer, ...] = ()
    if entry is not None and half_version is not None:
        offers = offers_of(capacities_of(fleet, entry.receive.zones), entry.receive.device_second)
    return SummaryBody(
        campus=ours.campus,
        peer=peer,
        broker=broker,
        seq=seq,
        at=at,
        ttl_s=min(60.0, TTL_INTERVALS * interval_s),
        agreement_version=half_version if half_version is not None else 0,
        currency=entry.receive.currency if entry is not None else "",
        device_second=entry.receive.device_second if entry is not None else 0.0,
        offers=offers,
    )


def _bucket(buckets: dict[str, Bucket], peer: str, rate: float, now: float) -> Bucket:
    bucket = buckets.get(peer)
    if bucket is None or bucket.rate != rate:
        bucket = buckets[peer] = Bucket(rate, rate, now)
    return bucket


@dataclass
class PeerOffers:
    """The newest kept summary from each peer, the last seq of each of its replicas, and the
    summaries refused, by reason."""

    latest: dict[str, SummaryBody] = field(default_factory=dict)
    seqs: dict[tuple[str, str], int] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)

    def hear(self, ours: Policy, signed: SignedSummary, *, now: float) -> PeerRefused | None:
        """Keep ``signed`` if it passes every check; else the refusal, counted."""
        refusal = _check(ours, signed, now, self.seqs)
        if refusal is not None:
            self.refused[refusal.code] += 1
            return refusal
        self.keep(signed.body)
        return None

    def keep(self, body: SummaryBody) -> None:
        """Keep a summary that passed the checks (the twin's, which models no keys, are
        taken as they are made)."""
        self.seqs[(body.campus, body.broker)] = body.seq
        self.latest[body.campus] = body

    def fresh(self, peer: str, *, now: float) -> SummaryBody | None:
        body = self.latest.get(peer)
        if body is None or now >= body.at + body.ttl_s:
            return None
        return body

    def candidate(
        self,
        ours: Policy,
        peer: str,
        standing: Standing,
        *,
        model: str,
        data_class: str,
        now: float,
    ) -> Offer | PeerRefused:
        """The best offer of ``peer`` for ``model``, or why its pool is not a candidate."""
        entry = ours.peers.get(peer)
        if entry is None or not standing.in_force:
            return PeerRefused("no_agreement", standing.reason)
        if data_class not in entry.send.classes:
            listed = ", ".join(sorted(entry.send.classes)) or "none"
            return PeerRefused(
                "class_not_listed",
                f"class {data_class!r} may not go to {peer!r} (the agreement lists {listed})",
            )
        body = self.fresh(peer, now=now)
        if body is None:
            return PeerRefused("stale", f"no fresh summary from {peer!r}")
        if body.agreement_version != standing.version:
            return PeerRefused(
                "withdrawn",
                f"{peer!r} says v{body.agreement_version} of its half is in force, "
                f"v{standing.version} is held here",
            )
        offers = [o for o in body.offers if o.model == model and o.free_slots > 0]
        if not offers:
            return PeerRefused("no_capacity", f"{peer!r} offers no free slot for {model!r}")
        return max(offers, key=lambda o: (o.score, o.free_slots, o.device_class))


def _check(
    ours: Policy, signed: SignedSummary, now: float, seqs: dict[tuple[str, str], int]
) -> PeerRefused | None:
    body = signed.body
    entry = ours.peers.get(body.campus)
    if body.peer != ours.campus or entry is None:
        return PeerRefused(
            "wrong_parties",
            f"a summary from {body.campus!r} to {body.peer!r}; this is {ours.campus!r}, "
            f"whose peers are {', '.join(sorted(ours.peers)) or 'none'}",
        )
    public = entry.brokers.get(body.broker)
    if public is None:
        return PeerRefused(
            "unknown_broker",
            f"signed by {body.broker!r}, not a replica [peers.{body.campus}] pins",
        )
    if not signed.verifies(public):
        return PeerRefused("bad_signature", f"{body.broker!r}'s signature does not verify")
    last = seqs.get((body.campus, body.broker), 0)
    if body.seq <= last:
        return PeerRefused("replayed", f"seq {body.seq} of {body.broker!r}, {last} held")
    if body.at > now + MAX_AHEAD_S:
        return PeerRefused("from_the_future", f"dated {body.at - now:.1f} s ahead of this clock")
    if now >= body.at + body.ttl_s:
        return PeerRefused("stale", f"{now - body.at:.1f} s old, valid {body.ttl_s:g} s")
    return None


@dataclass(frozen=True, slots=True)
class Link:
    """The link to a peer as its probes measured it: round trip and throughput."""

    rtt_s: float
    bytes_per_s: float


PROBE_ALPHA = 0.3  # weight of a new sample in the moving averages
PROBE_LOST_S = 10.0  # a probe not echoed by then is lost
LINK_STALE_S = 5.0  # no echo for this long: the link is not known
MIN_BYTES_PER_S = 1e3


@dataclass
class LinkMeter:
    """One peer's link from probes: the round trip of small probes and the throughput of
    padded ones (their extra time over a small probe's round trip), each a moving average;
    unknown until both were measured, and again when no echo came for ``LINK_STALE_S``."""

    pending: dict[str, tuple[float, int]] = field(default_factory=dict)  # nonce: (sent, pad)
    rtt_s: float | None = None
    bytes_per_s: float | None = None
    last_echo: float = float("-inf")
    lost: int = 0

    def sent(self, nonce: str, at: float, pad_bytes: int) -> None:
        self.pending[nonce] = (at, pad_bytes)
        for old, (when, _pad) in list(self.pending.items()):
            if at - when > PROBE_LOST_S:
                del self.pending[old]
                self.lost += 1

    def echoed(self, nonce: str, now: float) -> float | None:
        """A probe's echo came back: its round trip in s (None: not one of ours, or lost)."""
        probe = self.pending.pop(nonce, None)
        if probe is None:
            return None
        sent_at, pad = probe
        rtt = max(0.0, now - sent_at)
        self.last_echo = now
        if pad == 0:
            self.rtt_s = _ewma(self.rtt_s, rtt)
        elif self.rtt_s is not None:
            extra = max(rtt - self.rtt_s, pad / 1e9)
            self.bytes_per_s = max(MIN_BYTES_PER_S, _ewma(self.bytes_per_s, pad / extra))
        return rtt

    def link(self, now: float) -> Link | None:
        if self.rtt_s is None or self.bytes_per_s is None or now - self.last_echo > LINK_STALE_S:
            return None
        return Link(self.rtt_s, self.bytes_per_s)


def _ewma(previous: float | None, sample: float) -> float:
    return sample if previous is None else previous + PROBE_ALPHA * (sample - previous)


def remote_completion_s(offer: Offer, link: Link, image_bytes: int, result_bytes: int) -> float:
    """When a job sent now would be answered: the image across, the peer's queue and
    service, the result back (each way half a round trip plus its bytes at the link's
    throughput)."""
    there = link.rtt_s / 2 + image_bytes / link.bytes_per_s
    back = link.rtt_s / 2 + result_bytes / link.bytes_per_s
    return there + (offer.queue_p50_ms + offer.service_ms) / 1000.0 + back
