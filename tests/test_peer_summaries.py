"""Two campuses' broker replicas on their bridge (broker.peers): each publishes its signed
half and a signed summary every interval, and hears the other's; the agreement comes into
force, the peer's pool becomes a candidate, a withdrawal is heard from the next summary, and
a forged summary is refused and counted (issue 39, parts 1 and 3). Real processes: two CAs,
two secured Mosquittos and the bridge; the replicas' fleets are fed as telemetry would."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.core.fleet import Fleet
from broker.core.peering import PeerRefused
from broker.peers import Peers, half_file
from policies.agreement import statement_for
from policies.model import Policy
from sluicegate import topics
from sluicegate.mqtt.bridge import MqttTransport
from sluicegate.transport import Message
from sluicegate.wire_peer import Offer, SummaryBody, sign_summary
from tests.peer_kit import Site, bridged_sites
from tests.policies.policy_testkit import PARTS_TERMS, SITE_ZONES, key, policy_of, site_doc
from tests.test_broker_core_kit import caps, fleet_with

pytestmark = pytest.mark.integration

NORTH, SOUTH = "north-site", "south-site"
INTERVAL = 0.2
DELAY_S = 0.025  # the relay holds every byte this long each way: a 50 ms round trip at least


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Site, Site]]:
    root = tmp_path_factory.mktemp("summaries")
    with bridged_sites(root, send=PARTS_TERMS, delay_s=DELAY_S) as pair:
        yield pair


def sign_half(site: Site, policy: Policy, peer: str, officers: tuple[str, ...]) -> None:
    half = statement_for(policy, peer)
    for name in officers:
        half = half.signed_by(key(name), name)
    half_file(site.campus.root, policy.campus, peer).write_bytes(half.to_bytes())


def south_fleet(policy: Policy) -> Fleet:
    zone = SITE_ZONES[SOUTH]
    worker = caps("south-site-gpu-1", zone, device_class="gpu", models=("ocr-rec",))
    return fleet_with(
        policy,
        [(worker, {"capacity": 4, "backlog_ms": 8.0, "service_ms": {"ocr-rec": 6.0}})],
        now=time.time(),
    )


async def until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_halves_and_summaries_cross_and_a_withdrawal_stops_the_offers(
    sites: tuple[Site, Site],
) -> None:
    north, south = sites
    sign_half(north, north.policy, SOUTH, ("officer-alice", "officer-bob"))
    sign_half(south, south.policy, NORTH, ("officer-dan", "officer-erin"))
    south_policy: list[Policy] = [south.policy]
    n_transport = MqttTransport(north.campus.mqtt(north.broker), client_id=north.broker)
    s_transport = MqttTransport(south.campus.mqtt(south.broker), client_id=south.broker)
    async with n_transport, s_transport:
        refused: list[tuple[str, str]] = []
        lost: list[str] = []
        n_peers = Peers(
            n_transport,
            lambda: north.policy,
            key(north.broker),
            north.broker,
            Fleet(None, None, north.policy),
            north.campus.root,
            time.time,
            INTERVAL,
            on_refused=lambda kind, reason: refused.append((kind, reason)),
            link_lost=lost.append,
        )
        s_peers = Peers(
            s_transport,
            lambda: south_policy[0],
            key(south.broker),
            south.broker,
            south_fleet(south.policy),
            south.campus.root,
            time.time,
            INTERVAL,
        )
        tasks = [asyncio.create_task(p.run()) for p in (n_peers, s_peers)]
        try:

            def offer(data_class: str = "ocr-crop") -> Offer | PeerRefused:
                return n_peers.offers.candidate(
                    north.policy,
                    SOUTH,
                    n_peers.standing(SOUTH),
                    model="ocr-rec",
                    data_class=data_class,
                    now=time.time(),
                )

            await until(lambda: isinstance(offer(), Offer), "south's offer at north")
            got = offer()
            assert isinstance(got, Offer)
            assert (got.device_class, got.free_slots, got.queue_p50_ms) == ("gpu", 4, 8.0)
            assert n_peers.standing(SOUTH).code == "in_force"
            await until(lambda: s_peers.standing(NORTH).in_force, "north's half at south")
            # The probes measured the link, relay and all: never under its round trip.
            await until(lambda: n_peers.link(SOUTH) is not None, "the link measured at north")
            link = n_peers.link(SOUTH)
            assert link is not None
            assert link.rtt_s >= 2 * DELAY_S
            assert link.bytes_per_s > 0
            in_force, free, rtt = n_peers.facts()[SOUTH]  # what /metrics shows
            assert (in_force, free) == (True, 4)
            assert rtt is not None
            assert rtt >= 2 * DELAY_S

            # The link is cut: Mosquitto says at once that north's bridge is down, so the
            # link is not known and the jobs out there go back (link_lost); south's
            # summaries go stale, the pool is no candidate; the link is mended: the bridge
            # comes back, and so do the offers.
            assert north.relay is not None
            assert n_peers.describe()["peers"][0]["bridge"] == "up"
            lost.clear()  # (a bridge not yet connected when north began counts as down)
            north.relay.cut()
            await until(lambda: lost == [SOUTH], "the bridge down at north", timeout=5.0)
            assert n_peers.link(SOUTH) is None
            assert n_peers.describe()["peers"][0]["bridge"] == "down"

            def stale() -> bool:
                got = offer()
                return isinstance(got, PeerRefused) and got.code == "stale"

            await until(stale, "south's offer going stale at north")
            north.relay.mend()
            await until(lambda: isinstance(offer(), Offer), "the offer back", timeout=30.0)
            await until(lambda: n_peers.link(SOUTH) is not None, "the link known again")
            assert lost == [SOUTH]  # one loss, told once
            wafer = offer("wafer-image")
            assert isinstance(wafer, PeerRefused)
            assert wafer.code == "class_not_listed"

            # A summary signed by a key north's entry does not pin, on south's tree to north
            # (south's broker may write there): it crosses, and north refuses and counts it.
            forged = SummaryBody(
                campus=SOUTH,
                peer=NORTH,
                broker="south-site-broker-1",
                seq=2**40,
                at=time.time(),
                ttl_s=3.0,
                agreement_version=1,
            )
            await s_transport.publish(
                Message(
                    topics.peer_summary(SOUTH, NORTH), sign_summary(forged, key("intruder")), qos=1
                ),
                wait=True,
            )
            await until(lambda: n_peers.offers.refused["bad_signature"] >= 1, "the refusal")
            assert ("summary", "bad_signature") in refused
            assert isinstance(offer(), Offer)  # the forged one changed nothing

            # South's officers withdraw: policy v2 without [peers], and its half signed for
            # v2 (a withdrawal). Its next summary says so, and its withdrawal follows.
            doc = site_doc(SOUTH, NORTH, send={}, receive=PARTS_TERMS, version=2)
            doc["peers"] = {}
            withdrawn_policy = policy_of(doc)
            sign_half(south, withdrawn_policy, NORTH, ("officer-dan", "officer-erin"))
            south_policy[0] = withdrawn_policy

            def refused_now() -> bool:
                return isinstance(offer(), PeerRefused)

            # Whichever comes first, the summary or the half, the offers stop.
            await until(refused_now, "the withdrawal at north")
            first = offer()
            assert isinstance(first, PeerRefused)
            assert first.code in ("withdrawn", "no_agreement"), first.reason
            await until(
                lambda: n_peers.standing(SOUTH).code == "withdrawn", "south's signed withdrawal"
            )
            assert n_peers.standing(SOUTH).version == 2
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def test_a_half_the_officers_did_not_sign_enough_is_not_published(
    sites: tuple[Site, Site], tmp_path: Path
) -> None:
    north, _south = sites
    policy = north.policy
    half = statement_for(policy, SOUTH).signed_by(key("officer-alice"), "alice")
    half_file(tmp_path, policy.campus, SOUTH).write_bytes(half.to_bytes())
    peers = Peers(
        MqttTransport(north.campus.mqtt(north.broker), client_id="unused"),
        lambda: policy,
        key(north.broker),
        north.broker,
        Fleet(None, None, policy),
        tmp_path,
        time.time,
    )
    assert peers.own_half(policy, SOUTH) is None
    half = half.signed_by(key("officer-bob"), "bob")
    half_file(tmp_path, policy.campus, SOUTH).write_bytes(half.to_bytes())
    assert peers.own_half(policy, SOUTH) == half
