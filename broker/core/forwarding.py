"""Whether a job no worker here can take in time goes to a sister campus, and to which:
pure.

A request the local decision refused for want of a worker (none, none with room, none faster
than the edge, none the policy or sealing allows here), or placed on a worker here that
would finish it after its deadline, is offered to the peers this campus may send to. A peer
is a candidate only as ``broker.core.peering.PeerOffers.candidate`` says (the agreement in
force, the class listed, a fresh summary from the same half, a free slot for the model), and
only while its link is measured. Its answer must reach the edge before the edge stops
waiting (the link's round trip and ``ASK_MARGIN_S``, within twice the request's
``max_wait_ms``, which is half the edge's own wait, less what the request already waited
here), and its result must come before the deadline (the ask, then
``peering.remote_completion_s``). The candidate whose result would come first wins; with
none, the refusal says each peer's reason. No clock, no I/O: ``now`` is an argument.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from broker.core.peering import Link, PeerOffers, PeerRefused, remote_completion_s
from policies.agreement import Standing
from policies.model import Policy
from sluicegate.wire_peer import Offer
from sluicegate.wire_pool import PlacementRequest

# The local refusals a peer may do better than: every one for want of a worker here.
FORWARDABLE = frozenset(
    {"no_worker", "no_capacity", "no_faster_worker", "policy_denied", "seal_unavailable"}
)
ASK_MARGIN_S = 0.010  # the peer's decision and the relay both ways, beyond the round trip
RESULT_BYTES = 2048  # a result document, for the time it takes back across the link


@dataclass(frozen=True, slots=True)
class Forward:
    """Ask ``peer``: its best offer, until when its answer is worth relaying (unix s; then
    the edge stops waiting), and when the job's result would be back."""

    peer: str
    offer: Offer
    answer_by: float
    done_at: float


def forward_to(
    ours: Policy,
    request: PlacementRequest,
    offers: PeerOffers,
    standing: Callable[[str], Standing],
    links: Mapping[str, Link | None],
    *,
    now: float,
    waited_s: float,
) -> Forward | PeerRefused:
    """The peer to ask for ``request`` (which waited ``waited_s`` here already), or why
    none: each peer's reason, joined."""
    best: Forward | None = None
    why: list[str] = []
    for peer in ours.peers_out():
        offer = offers.candidate(
            ours,
            peer,
            standing(peer),
            model=request.model,
            data_class=request.data_class,
            now=now,
        )
        if isinstance(offer, PeerRefused):
            why.append(f"{peer}: {offer.reason}")
            continue
        link = links.get(peer)
        if link is None:
            why.append(f"{peer}: the link is not measured yet")
            continue
        answer_in = link.rtt_s + ASK_MARGIN_S
        edge_waits = 2.0 * request.max_wait_ms / 1000.0 - waited_s
        if answer_in > edge_waits:
            why.append(
                f"{peer}: its answer takes {answer_in * 1000:.0f} ms, the edge waits "
                f"{max(edge_waits, 0.0) * 1000:.0f} ms more"
            )
            continue
        done_at = (
            now + answer_in + remote_completion_s(offer, link, request.payload_bytes, RESULT_BYTES)
        )
        if request.deadline_at is not None and done_at > request.deadline_at:
            late = (done_at - request.deadline_at) * 1000.0
            why.append(f"{peer}: its result would come {late:.0f} ms after the deadline")
            continue
        if best is None or done_at < best.done_at:
            best = Forward(peer, offer, now + edge_waits, done_at)
    if best is not None:
        return best
    return PeerRefused("no_peer", "; ".join(why) or "this campus sends no class to a peer")
