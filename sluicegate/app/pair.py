"""Two whole campuses on one machine, north and south, as two plants run them: each written
by ``write_campus`` (its own CA, officer, broker key, policy, ACL) and run by ``LocalCampus``
(each node its own process) on a Mosquitto of its own and a Redis database of its own. Each
policy names the other under ``[peers]`` with mirrored terms (north sends the classes
``sent`` to south's data centre), each campus's half of the agreement is signed by its
officer beside its policy, and each campus's Mosquitto pulls what the other says to it over
a bridge of its own (a certificate from the other's CA, ``sluicegate.mosquitto.bridge_lines``
with ``pull``), each through a :class:`~sluicegate.app.link.DelayRelay` that holds every
byte ``delay_s`` each way: the long link between two fabs (:class:`Link` cuts and mends
both). With ``wiretap``, an identity of south's CA may read everything
that crossed to south (``peer/#``) and nothing else: what a test or a benchmark watches the
bridge with. The peering tests and ``bench/peering.py`` run on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.peers import half_file
from policies import SigningKey, parse_policy
from policies.agreement import statement_for
from sluicegate import topics
from sluicegate.app.broker_http import get_json
from sluicegate.app.link import DelayRelay
from sluicegate.app.localcampus import LocalCampus
from sluicegate.app.servers import free_port, running, start_mosquitto
from sluicegate.enroll.authority import Authority, init_folder
from sluicegate.mosquitto import BridgeTls, bridge_lines

NORTH, SOUTH = "north-site", "south-site"
FABS = {NORTH: "campus/fab-north", SOUTH: "campus/fab-south"}
SOUTH_DC = "campus/fab-south/dc"
WIRETAP = "wiretap"  # south's identity that reads what crossed (``wiretap=True``)


def peer_table(
    peer: str,
    fingerprint: str,
    key_for: Callable[[str], SigningKey],
    *,
    sends: bool,
    sent: Collection[str],
    max_jobs_per_s: float = 500.0,
) -> str:
    """One campus's ``[peers.<peer>]``: the peer's CA, broker and officer; the terms, the
    sender's ``send`` mirrored by the receiver's ``receive`` (at most ``max_jobs_per_s``)."""
    classes = ", ".join(f'"{c}"' for c in sorted(sent))
    officer = key_for("officer").public_text
    terms = (
        f'classes = [{classes}]\nzones = ["{SOUTH_DC}"]\n'
        f"max_jobs_per_s = {max_jobs_per_s!r}\nmax_bytes_per_s = 1e9\n"
        'currency = "EUR"\ndevice_second = 0.002\n'
    )
    return (
        f"[peers.{peer}]\n"
        f'ca_fingerprint = "{fingerprint}"\n'
        f'brokers = {{ broker-1 = "{key_for("broker-1").public_text}" }}\n'
        f'officers = {{ threshold = 1, keys = {{ officer = "{officer}" }} }}\n'
        f"\n[peers.{peer}.{'send' if sends else 'receive'}]\n{terms}"
    )


@dataclass(frozen=True)
class Link:
    """The link between the two campuses: one relay each way (each campus's bridge pulls
    through its own), cut and mended together."""

    relays: tuple[DelayRelay, ...]

    def cut(self) -> None:
        for relay in self.relays:
            relay.cut()

    def mend(self) -> None:
        for relay in self.relays:
            relay.mend()


@dataclass
class Pair:
    north: LocalCampus
    south: LocalCampus
    relay: Link
    wiretap: Path | None  # south's wiretap identity's folder (node.key, node.pem, ca.pem)

    def peers_seen(self, campus: LocalCampus) -> dict[str, Any]:
        """What ``campus``'s broker shows on ``GET /peers`` now."""
        assert campus.campus is not None
        url = f"http://127.0.0.1:{campus.http_port}/peers"
        status, shown = get_json(url, campus.campus.console_token("viewer"), timeout=10)
        if status != 200:
            raise RuntimeError(f"GET {url}: HTTP {status}: {shown}")
        return dict(shown)

    def wait_offered(self, timeout: float = 60.0, *, offered: bool = True) -> dict[str, Any]:
        """Once north holds south's agreement in force, a fresh offer and the link measured
        (with ``offered=False``: once it holds no fresh offer, as after a cut)."""
        deadline = time.monotonic() + timeout
        while True:
            (peer,) = self.peers_seen(self.north)["peers"]
            ready = peer["standing"] == "in_force" and peer["offers"] and peer["link"]
            if bool(ready) == offered:
                return dict(peer)
            if time.monotonic() > deadline:
                raise TimeoutError(f"south is {'not ' if offered else ''}offered to north: {peer}")
            time.sleep(0.2)


@contextmanager
def local_pair(
    root: Path,
    redis_url: Callable[[], str],
    key_for: Callable[[str, str], SigningKey],
    *,
    north_nodes: Collection[str],
    south_nodes: Collection[str],
    delay_s: float = 0.005,
    sent: Collection[str] = ("ocr-crop",),
    north_confidential: Collection[str] = (),
    north_env: dict[str, dict[str, str]] | None = None,
    wiretap: bool = False,
    edge_cpu: float | None = None,
    pull: bool = True,
) -> Iterator[Pair]:
    """North and south running ``north_nodes`` and ``south_nodes``, bridged and agreed;
    ``key_for(campus, name)`` gives each campus's keys; ``north_confidential``: classes
    besides wafer images north keeps sealed; ``north_env``: extra environment for one of
    north's nodes; ``edge_cpu``: north's line PCs capped to this share of a core
    (``LocalCampus``); ``pull``: each campus pulls through a bridge of its own (else one
    bridge, north's, carries both trees)."""
    now = time.time()
    roots = {NORTH: root / "north", SOUTH: root / "south"}
    prints: dict[str, str] = {}
    for campus, folder in roots.items():  # the CAs first: each policy pins the other's
        folder.mkdir(parents=True)
        init_folder(folder, campus, now=now)
        prints[campus] = Authority(folder).ca_fingerprint
    ports = {campus: free_port() for campus in roots}
    keys = {c: (lambda name, c=c: key_for(c, name)) for c in roots}
    sides = {
        campus: LocalCampus(
            roots[campus],
            mqtt_port=ports[campus],
            redis_url=redis_url(),
            key_for=keys[campus],
            nodes=north_nodes if campus == NORTH else south_nodes,
            node_env=north_env if campus == NORTH else None,
            campus=campus,
            fab=FABS[campus],
            peers=peer_table(other, prints[other], keys[other], sends=campus == NORTH, sent=sent),
            also_confidential=north_confidential if campus == NORTH else (),
            edge_cpu=edge_cpu if campus == NORTH else None,
        )
        for campus, other in ((NORTH, SOUTH), (SOUTH, NORTH))
    }
    for campus, side in sides.items():
        written = side.write()
        policy = parse_policy(written.policy_file.read_bytes(), source=str(written.policy_file))
        peer = SOUTH if campus == NORTH else NORTH
        half = statement_for(policy, peer).signed_by(keys[campus]("officer"), "officer")
        half_file(roots[campus], campus, peer).write_bytes(half.to_bytes())
    # Each campus pulls what the other says to it: a bridge on each side, with a
    # certificate from the other's CA, each through a link of its own.
    south_ca = Authority(roots[SOUTH])
    for campus, other in ((NORTH, SOUTH), (SOUTH, NORTH)):
        bridge = roots[campus] / "bridge"
        bridge.mkdir()
        Authority(roots[other]).issue_here(
            topics.peer_bridge_identity(campus), "bridge", bridge, now=now
        )
    tap: Path | None = None
    if wiretap:
        tap = roots[SOUTH] / WIRETAP
        tap.mkdir()
        south_ca.issue_here(WIRETAP, "observer", tap, now=now)
        acl = roots[SOUTH] / "mosquitto.acl"
        acl.write_text(acl.read_text() + f"\nuser {WIRETAP}\ntopic read {topics.ROOT}/peer/#\n")
    bridging = ((NORTH, SOUTH), (SOUTH, NORTH)) if pull else ((NORTH, SOUTH),)
    relays = {campus: DelayRelay(ports[other], delay_s) for campus, other in bridging}
    stanzas: dict[str, tuple[str, ...]] = {NORTH: (), SOUTH: ()}
    for campus, other in bridging:
        bridge = roots[campus] / "bridge"
        tls = BridgeTls(bridge / "ca.pem", bridge / "node.pem", bridge / "node.key")
        address = f"127.0.0.1:{relays[campus].port}"
        stanzas[campus] = tuple(bridge_lines(campus, other, address, tls, pull=pull))
    for folder in roots.values():
        (folder / "mq").mkdir()
    north, south = sides[NORTH], sides[SOUTH]
    with ExitStack() as stack:
        for relay in relays.values():
            stack.callback(relay.close)
        for campus, side in sides.items():
            written = side.write()
            side.servers["mosquitto"] = stack.enter_context(
                running(
                    start_mosquitto(
                        port=ports[campus],
                        workdir=roots[campus] / "mq",
                        tls=written.listener_tls(),
                        probe=written.client_context(),
                        extra_config=stanzas[campus],
                    )
                )
            )
        stack.callback(south.stop)
        south.start()
        stack.callback(north.stop)
        north.start()
        yield Pair(north, south, Link(tuple(relays.values())), tap)
