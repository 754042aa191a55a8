"""Two sister campuses joined by Mosquitto's own bridge, as `sluicegate.mosquitto` writes it
and each policy's ACL allows: what one campus says to the other crosses, over TLS with the
peer's CA and MQTT v5 properties intact, and nothing else does, either way (issue 39,
part 2). Real processes: two CAs, two secured Mosquittos, the bridge between them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode
from typer.testing import CliRunner, Result

from sluicegate import topics
from sluicegate.acl import render_acl
from sluicegate.app.cli import app
from sluicegate.mosquitto import BridgeTls, bridge_lines
from tests.peer_kit import WIRETAP, Site, bridged_sites, write_site
from tests.policies.policy_testkit import PARTS_TERMS
from tests.secure_kit import TlsClient

pytestmark = pytest.mark.integration

NORTH, SOUTH = "north-site", "south-site"


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Site, Site]]:
    with bridged_sites(tmp_path_factory.mktemp("peers"), send=PARTS_TERMS) as pair:
        yield pair


class Tap(TlsClient):
    """A client that keeps the topics of what it received before the one it waits for."""

    seen: list[str]

    def until(self, topic: str, timeout: float = 15.0) -> bytes:
        """The payload of the first message on ``topic``; the others go to ``seen``."""
        while True:
            got = self.get(timeout=timeout)
            if got.topic == topic:
                return got.payload
            self.seen.append(got.topic)


def listen(site: Site, identity: str, topic_filter: str) -> Tap:
    client = Tap(site.campus, identity)
    client.seen = []
    client.subscribe(topic_filter)
    return client


def test_what_a_campus_says_to_its_peer_crosses_with_its_properties(
    sites: tuple[Site, Site],
) -> None:
    north, south = sites
    # Each broker reads what brokers say to each other (never the whole tree: images
    # cross there too).
    sender = listen(north, north.broker, topics.peer_agreement(SOUTH, NORTH))
    receiver = listen(south, south.broker, topics.peer_summary(NORTH, SOUTH))
    try:
        summary = topics.peer_summary(NORTH, SOUTH)
        sent = sender.publish(summary, b"offer-1", user=[("signed-by", north.broker)])
        assert not sent.is_failure
        assert receiver.until(summary) == b"offer-1"
        # And back: south's half of the agreement reaches north's broker.
        half = topics.peer_agreement(SOUTH, NORTH)
        assert not receiver.publish(half, b"south-half").is_failure
        assert sender.until(half) == b"south-half"
    finally:
        sender.close()
        receiver.close()


def test_a_retained_half_reaches_a_subscriber_that_comes_later(sites: tuple[Site, Site]) -> None:
    north, south = sites
    sender = TlsClient(north.campus, north.broker)
    half = topics.peer_agreement(NORTH, SOUTH)
    try:
        assert not sender.publish(half, b"north-half-v1", retain=True).is_failure
        # Seen crossing by a subscriber that was there, then held by south's Mosquitto for
        # one that subscribes afterwards (a broker replica starting later).
        first = listen(south, WIRETAP, "#")
        try:
            assert first.until(half) == b"north-half-v1"
        finally:
            first.close()
        later = TlsClient(south.campus, south.broker)
        try:
            later.subscribe(half)
            got = later.get(timeout=15)
            assert (got.topic, got.payload, got.retain) == (half, b"north-half-v1", True)
        finally:
            later.close()
    finally:
        sender.close()


def test_nothing_but_the_pairs_trees_crosses_either_way(sites: tuple[Site, Site]) -> None:
    north, south = sites
    south_tap, north_tap = listen(south, WIRETAP, "#"), listen(north, WIRETAP, "#")
    north_broker = TlsClient(north.campus, north.broker)
    south_broker = TlsClient(south.campus, south.broker)
    try:
        # Campus-internal traffic on each side (a broker's own status, the policy), then a
        # marker on the peer tree: the tap on the other side sees the marker and nothing
        # before it, while its own side's tap saw the internal messages.
        for broker, site in ((north_broker, north), (south_broker, south)):
            assert not broker.publish(topics.broker_status(site.broker), b"online").is_failure
            assert not broker.publish(topics.policy(), b"policy", retain=True).is_failure
        north_broker.publish(topics.peer_summary(NORTH, SOUTH), b"marker-n")
        south_broker.publish(topics.peer_summary(SOUTH, NORTH), b"marker-s")
        assert south_tap.until(topics.peer_summary(NORTH, SOUTH)) == b"marker-n"
        assert north_tap.until(topics.peer_summary(SOUTH, NORTH)) == b"marker-s"
        south_saw, north_saw = set(south_tap.seen), set(north_tap.seen)
        assert topics.broker_status(north.broker) not in south_saw
        assert topics.broker_status(south.broker) not in north_saw
        # Each tap did see its own side's internal message: it was there to be seen.
        assert topics.broker_status(north.broker) in north_saw
        assert topics.broker_status(south.broker) in south_saw
    finally:
        for client in (south_tap, north_tap, north_broker, south_broker):
            client.close()


def test_the_bridge_identity_may_write_only_its_campus_s_tree_on_the_peer(
    tmp_path: Path,
) -> None:
    with bridged_sites(tmp_path, send=PARTS_TERMS, bridge=False) as (_north, south):
        _the_bridge_identity_on(south)


def _the_bridge_identity_on(south: Site) -> None:
    acl = render_acl(south.policy)
    bridge = topics.peer_bridge_identity(NORTH)
    block = acl.split(f"user {bridge}\n")[1].split("\n\n")[0].splitlines()
    assert block == [
        f"topic deny {topics.policy()}",
        f"topic write {topics.peer_tree(NORTH, SOUTH)}",
        f"topic read {topics.peer_tree(SOUTH, NORTH)}",
    ]
    # On the wire: a client holding the bridge's certificate (south's CA) publishing into
    # south's own topics is refused by south's Mosquitto.
    intruder = _as_bridge(south)
    south_broker = TlsClient(south.campus, south.broker)
    try:
        # It reads neither south's policy (retained) nor anything but south's tree to it.
        assert not south_broker.publish(topics.policy(), b"south-policy", retain=True).is_failure
        intruder.subscribe(topics.policy())
        intruder.subscribe(topics.peer_tree(SOUTH, NORTH))
        marker = topics.peer_summary(SOUTH, NORTH)
        assert not south_broker.publish(marker, b"after").is_failure
        got = intruder.get(timeout=15)
        assert (got.topic, got.payload) == (marker, b"after")
        refused = intruder.publish(topics.edge_submit("north-l1-pc"), b"jpeg")
        assert refused == ReasonCode(PacketTypes.PUBACK, "Not authorized")
        allowed = intruder.publish(topics.peer_summary(NORTH, SOUTH), b"ok")
        assert not allowed.is_failure
    finally:
        intruder.close()
        south_broker.close()


def _as_bridge(south: Site) -> TlsClient:
    """A client on south holding the key and certificate south's CA issued north's bridge."""
    bridge = topics.peer_bridge_identity(NORTH)
    issued = south.campus.root.parent / "north" / "bridge"
    south.campus.cert_file(bridge).write_bytes((issued / "node.pem").read_bytes())
    south.campus.key_files[bridge] = issued / "node.key"
    return TlsClient(south.campus, bridge, client_id=bridge)


def test_the_bridge_stanza_names_only_the_pair_s_trees(tmp_path: Path) -> None:
    tls = BridgeTls(tmp_path / "ca.pem", tmp_path / "bridge.pem", tmp_path / "bridge.key")
    lines = bridge_lines(NORTH, SOUTH, "fab-south.example:8883", tls)
    assert [line for line in lines if line.startswith("topic ")] == [
        f"topic {topics.peer_tree(NORTH, SOUTH)} out 1",
        f"topic {topics.peer_tree(SOUTH, NORTH)} in 1",
    ]
    assert "bridge_protocol_version mqttv311" in lines  # Mosquitto < 2.0.14 bridges no v5
    assert "try_private true" in lines  # retained messages keep their flag across
    # Pulled: only the peer's tree to us comes in (the peer runs the mirror bridge).
    pulled = bridge_lines(NORTH, SOUTH, "fab-south.example:8883", tls, pull=True)
    assert [line for line in pulled if line.startswith("topic ")] == [
        f"topic {topics.peer_tree(SOUTH, NORTH)} in 1",
    ]
    v5 = bridge_lines(NORTH, SOUTH, "fab-south.example:8883", tls, protocol="mqttv50")
    assert "bridge_protocol_version mqttv50" in v5
    assert "bridge_insecure false" in lines
    assert f"bridge_cafile {tls.cafile}" in lines


def sg(*args: object) -> Result:
    """A ``sluicegate`` command, its arguments as text."""
    return CliRunner().invoke(app, [str(a) for a in args])


def ca_issue_bridge(site: Site, node: str, state_dir: Path) -> Result:
    """``sluicegate ca issue --role bridge`` on ``site``'s CA."""
    ca = ("--ca-dir", site.campus.root, "--state-dir", state_dir)
    return sg("ca", "issue", *ca, "--node", node, "--role", "bridge")


def test_bridge_commands_name_what_is_wrong(tmp_path: Path) -> None:
    site = write_site(tmp_path / "north", NORTH, SOUTH, send=PARTS_TERMS, receive={})
    wrong_node = ca_issue_bridge(site, "south-bridge", tmp_path)
    assert wrong_node.exit_code != 0
    assert "'peer.<its campus id>' with --role bridge" in wrong_node.output
    files = (
        ("--peer-ca", site.campus.ca_file),
        ("--cert", site.campus.cert_file(site.broker)),
        ("--key", site.campus.key_files[site.broker]),
    )
    where = ("--policy", site.campus.policy_file, "--address", "127.0.0.1:8883")
    unknown_peer = sg("mosquitto", "bridge", *where, "--peer", "west-site", *sum(files, ()))
    assert unknown_peer.exit_code == 2
    assert "'west-site': policy v1 does not list it ([peers]: south-site)" in unknown_peer.output


def test_enroll_list_says_whose_bridge_an_identity_is(tmp_path: Path) -> None:
    site = write_site(tmp_path / "south", SOUTH, NORTH, send={}, receive=PARTS_TERMS)
    for node in (topics.peer_bridge_identity(NORTH), topics.peer_bridge_identity("west-site")):
        issued = ca_issue_bridge(site, node, tmp_path / node)
        assert issued.exit_code == 0, issued.output
    listed = sg("enroll", "list", "--ca-dir", site.campus.root, "--policy", site.campus.policy_file)
    assert listed.exit_code == 0, listed.output
    assert "sister campus 'north-site', which [peers] lists" in listed.output
    assert "'west-site', which [peers] does not list: it may do nothing" in listed.output
