"""A broker's placements on a sister campus's workers after it relayed them
(broker.forwarding): the peer's notice of a lost worker passed on to the edge only for the
very placement this replica relayed; the bridge going down sends every job out there back to
its edge and refuses the asks still waiting; a placement the edge hands back goes back
across, once. On an in-memory MQTT broker; the decisions are the production ones."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from broker.core.fleet import Fleet
from broker.core.peering import LinkMeter
from broker.forwarding import Forwarder
from broker.peers import Peers
from broker.waiting_room import Pending
from policies.agreement import statement_for
from sluicegate import topics, wire
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.transport import Message
from sluicegate.wire_pool import JobNotice, PlacementRelease, PlacementReply
from tests.policies.policy_testkit import key
from tests.test_broker_core_forwarding import ask
from tests.test_broker_peering import NORTH, NOW, SOUTH, body

PEER, US, EDGE, WORKER = "south-site", "north-site", "north-l1-pc", "south-site-gpu-1"
BROKER = "north-site-broker-1"


@dataclass
class Rig:
    broker: MemoryBroker
    forwarder: Forwarder
    relayed: list[PlacementReply] = field(default_factory=list)
    refused: list[tuple[str, str, str]] = field(default_factory=list)  # job, code, reason

    def sent(self, topic: str) -> list[Message]:
        return [m for m in self.broker.log if m.topic == topic]

    def asked(self, job_id: str) -> None:
        item = Pending(
            ask(job_id=job_id), topics.placement_replies(EDGE), None, time.perf_counter()
        )
        assert self.forwarder.forward(item, NOW)

    def answered(self, job_id: str, **reply: Any) -> None:
        fields = {"job_id": job_id, "status": "placed", "worker_id": WORKER, **reply}
        answer = PlacementReply.model_validate(fields)
        self.forwarder.on_answer(Message(topics.peer_answers(PEER, US), wire.dump(answer)))

    def notice(self, job_id: str, *, edge: str = EDGE, attempt: int = 1, peer: str = PEER) -> None:
        told = JobNotice(
            job_id=job_id,
            attempt=attempt,
            kind="worker_lost",
            worker_id=WORKER,
            crashes=1,
            reason="its worker went offline",
        )
        self.forwarder.on_notice(Message(topics.peer_notices(peer, US, edge), wire.dump(told)))

    def edge_notices(self) -> list[JobNotice]:
        return [
            JobNotice.model_validate_json(m.payload) for m in self.sent(topics.edge_notices(EDGE))
        ]


def north_peers(transport: MemoryTransport, **hooks: Any) -> Peers:
    """North's replica's side of its agreements, on the in-memory broker."""
    return Peers(
        transport,
        lambda: NORTH,
        key(BROKER),
        BROKER,
        Fleet(None, None, NORTH),
        None,
        lambda: NOW,
        **hooks,
    )


@pytest.fixture
def rig() -> Rig:
    broker = MemoryBroker()
    transport = MemoryTransport(broker, client_id=BROKER)
    peers = north_peers(transport)
    half = statement_for(SOUTH, US)
    half = half.signed_by(key("officer-dan"), "dan").signed_by(key("officer-erin"), "erin")
    assert peers.book.offer(NORTH, half)
    peers.offers.keep(body())
    peers.meters[PEER] = LinkMeter(rtt_s=0.02, bytes_per_s=1e7, last_echo=NOW)
    relayed: list[PlacementReply] = []
    refused: list[tuple[str, str, str]] = []
    forwarder = Forwarder(
        transport,
        lambda: NORTH,
        peers,
        lambda: NOW,
        relay=lambda item, reply: relayed.append(reply),
        refuse=lambda item, code, why: refused.append((item.request.job_id, code, why)),
    )
    return Rig(broker, forwarder, relayed, refused)


async def test_a_peer_s_notice_reaches_the_edge_only_for_the_placement_relayed(rig: Rig) -> None:
    rig.asked("job-1")
    rig.answered("job-1")
    assert [r.campus for r in rig.relayed] == [PEER]
    rig.notice("job-9")  # a job it never relayed
    rig.notice("job-1", edge="north-l2-pc")  # another edge than the one that asked
    rig.notice("job-1", attempt=2)  # another attempt
    assert rig.edge_notices() == []
    assert rig.forwarder.notices[f"{PEER}.unknown"] == 3
    rig.notice("job-1")
    (told,) = rig.edge_notices()
    assert (told.job_id, told.attempt, told.kind) == ("job-1", 1, "worker_lost")
    assert told.worker_id == f"{WORKER}@{PEER}"  # as the edge names the peer's worker
    rig.notice("job-1")  # told once: the placement is no longer watched
    assert len(rig.edge_notices()) == 1


async def test_a_bridge_down_sends_the_jobs_out_there_back_and_refuses_waiting_asks(
    rig: Rig,
) -> None:
    rig.asked("job-1")
    rig.answered("job-1")
    rig.asked("job-2")  # its answer still to come
    rig.forwarder.link_lost(PEER)
    (told,) = rig.edge_notices()
    assert (told.job_id, told.attempt, told.kind) == ("job-1", 1, "worker_lost")
    assert "bridge to sister campus south-site is down" in told.reason
    assert [(job, code) for job, code, _ in rig.refused] == [("job-2", "peer_link_lost")]
    rig.answered("job-2")  # its answer after all: nobody waits for it any more
    assert [r.job_id for r in rig.relayed] == ["job-1"]
    rig.forwarder.link_lost(PEER)  # nothing is out there now
    assert len(rig.edge_notices()) == 1


async def test_a_placement_the_edge_hands_back_goes_back_across_once(rig: Rig) -> None:
    rig.asked("job-1")
    rig.answered("job-1")
    release = PlacementRelease(
        job_id="job-1", edge_id=EDGE, worker_id=f"{WORKER}@{PEER}", attempt=1, reason="late"
    )
    rig.forwarder.hand_back(release.model_copy(update={"attempt": 2}))  # not the one relayed
    assert rig.sent(topics.peer_releases(US, PEER)) == []
    rig.forwarder.hand_back(release)
    rig.forwarder.hand_back(release)  # again (another replica would hold no record)
    (across,) = rig.sent(topics.peer_releases(US, PEER))
    handed = PlacementRelease.model_validate_json(across.payload)
    assert (handed.job_id, handed.worker_id, handed.edge_id) == ("job-1", WORKER, EDGE)
    rig.notice("job-1")  # handed back: a notice for it changes nothing
    assert rig.edge_notices() == []


async def test_an_unreadable_notice_is_counted_and_dropped(rig: Rig) -> None:
    rig.forwarder.on_notice(Message(topics.peer_notices(PEER, US, EDGE), b"{not json"))
    assert rig.forwarder.notices[f"{PEER}.malformed"] == 1
    assert rig.edge_notices() == []


async def test_a_peer_s_release_names_the_peer_s_edge_and_a_malformed_one_is_counted() -> None:
    released: list[PlacementRelease] = []
    lost: list[str] = []
    peers = north_peers(
        MemoryTransport(MemoryBroker(), client_id=BROKER),
        release=released.append,
        link_lost=lost.append,
    )
    theirs = PlacementRelease(
        job_id="job-7", edge_id="south-l1-pc", worker_id="north-site-gpu-1", attempt=2
    )
    peers.on_message(Message(topics.peer_releases(PEER, US), wire.dump(theirs)))
    (got,) = released
    assert (got.edge_id, got.worker_id) == ("south-l1-pc@south-site", "north-site-gpu-1")
    peers.on_message(Message(topics.peer_releases(PEER, US), b'{"job_id": 7}'))
    assert peers.refused["release.malformed"] == 1
    assert len(released) == 1
    # Mosquitto's word on the bridge: down once (told once), up, and a campus not listed
    peers.meters[PEER] = LinkMeter(rtt_s=0.02, bytes_per_s=1e7, last_echo=NOW)
    assert peers.link(PEER) is not None
    peers.on_message(Message(topics.bridge_state(PEER), b"0"))
    peers.on_message(Message(topics.bridge_state(PEER), b"0"))
    assert lost == [PEER]
    assert peers.link(PEER) is None
    peers.on_message(Message(topics.bridge_state(PEER), b"1"))
    assert peers.link(PEER) is not None
    peers.on_message(Message(topics.bridge_state("west-site"), b"0"))
    assert lost == [PEER]
