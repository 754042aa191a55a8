"""Two whole campuses on this machine, north and south, as two plants would run them: each
written by ``write_campus`` (its own CA, officer, broker key, policy, ACL) and run by
``LocalCampus`` (each node its own process) on a Mosquitto of its own and a Redis database of
its own, each policy naming the other under ``[peers]`` with mirrored terms (north sends OCR
crops to south's data centre), each campus's half of the agreement signed by its officer
beside its policy, and north's Mosquitto bridged to south's (a certificate from south's CA,
``sluicegate mosquitto bridge``) through a :class:`~tests.peer_kit.DelayRelay` that holds
every byte ``delay_s`` each way: the long link between two fabs."""

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
from sluicegate.app.localcampus import LocalCampus, start_campus_mosquitto
from sluicegate.app.servers import ServerProcess, free_port, running, start_mosquitto
from sluicegate.enroll.authority import Authority, init_folder
from tests.peer_kit import DelayRelay, cli
from tests.policies.policy_testkit import key

NORTH, SOUTH = "north-site", "south-site"
FABS = {NORTH: "campus/fab-north", SOUTH: "campus/fab-south"}
SOUTH_DC = "campus/fab-south/dc"
SENT_CLASSES = ("ocr-crop",)  # what the agreement lets north send south


def key_for(campus: str) -> Callable[[str], SigningKey]:
    """A campus's published test keys: its own per name (both campuses name a broker-1)."""
    return lambda name: key(f"{campus}/{name}")


def peer_table(peer: str, fingerprint: str, *, sends: bool) -> str:
    """One campus's ``[peers.<peer>]``: the peer's CA, broker and officer; the terms, the
    sender's ``send`` mirrored by the receiver's ``receive``."""
    keys = key_for(peer)
    terms = (
        f'classes = {list(SENT_CLASSES)!r}\nzones = ["{SOUTH_DC}"]\n'.replace("'", '"')
        + "max_jobs_per_s = 500.0\nmax_bytes_per_s = 1e9\n"
        'currency = "EUR"\ndevice_second = 0.002\n'
    )
    return (
        f"[peers.{peer}]\n"
        f'ca_fingerprint = "{fingerprint}"\n'
        f'brokers = {{ broker-1 = "{keys("broker-1").public_text}" }}\n'
        f'officers = {{ threshold = 1, keys = {{ officer = "{keys("officer").public_text}" }} }}\n'
        f"\n[peers.{peer}.{'send' if sends else 'receive'}]\n{terms}"
    )


@dataclass
class TwoCampuses:
    north: LocalCampus
    south: LocalCampus
    relay: DelayRelay

    def peers_seen(self, campus: LocalCampus) -> dict[str, Any]:
        """What ``campus``'s broker shows on ``GET /peers`` now."""
        assert campus.campus is not None
        url = f"http://127.0.0.1:{campus.http_port}/peers"
        status, shown = get_json(url, campus.campus.console_token("viewer"), timeout=10)
        assert status == 200, shown
        return dict(shown)

    def wait_offered(self, timeout: float = 60.0) -> dict[str, Any]:
        """Once north holds south's agreement in force, a fresh offer and the link measured."""
        deadline = time.monotonic() + timeout
        while True:
            (peer,) = self.peers_seen(self.north)["peers"]
            if peer["standing"] == "in_force" and peer["offers"] and peer["link"]:
                return dict(peer)
            assert time.monotonic() < deadline, f"south is not offered to north: {peer}"
            time.sleep(0.2)


@contextmanager
def two_campuses(
    root: Path,
    redis_url: Callable[[], str],
    *,
    north_nodes: Collection[str],
    south_nodes: Collection[str],
    delay_s: float = 0.005,
    node_env: dict[str, dict[str, str]] | None = None,
) -> Iterator[TwoCampuses]:
    """North and south running ``north_nodes`` and ``south_nodes``, bridged and agreed."""
    now = time.time()
    roots = {NORTH: root / "north", SOUTH: root / "south"}
    prints: dict[str, str] = {}
    for campus, folder in roots.items():  # the CAs first: each policy pins the other's
        folder.mkdir(parents=True)
        init_folder(folder, campus, now=now)
        prints[campus] = Authority(folder).ca_fingerprint
    ports = {campus: free_port() for campus in roots}
    north = LocalCampus(
        roots[NORTH],
        mqtt_port=ports[NORTH],
        redis_url=redis_url(),
        key_for=key_for(NORTH),
        nodes=north_nodes,
        node_env=node_env,
        campus=NORTH,
        fab=FABS[NORTH],
        peers=peer_table(SOUTH, prints[SOUTH], sends=True),
    )
    south = LocalCampus(
        roots[SOUTH],
        mqtt_port=ports[SOUTH],
        redis_url=redis_url(),
        key_for=key_for(SOUTH),
        nodes=south_nodes,
        node_env=node_env,
        campus=SOUTH,
        fab=FABS[SOUTH],
        peers=peer_table(NORTH, prints[NORTH], sends=False),
    )
    for campus, side in ((NORTH, north), (SOUTH, south)):
        written = side.write()
        policy = parse_policy(written.policy_file.read_bytes(), source="test")
        peer = SOUTH if campus == NORTH else NORTH
        half = statement_for(policy, peer).signed_by(key_for(campus)("officer"), "officer")
        half_file(roots[campus], campus, peer).write_bytes(half.to_bytes())
    bridge = roots[NORTH] / "bridge"
    bridge.mkdir()
    cli("ca", "issue", "--ca-dir", roots[SOUTH], "--state-dir", bridge, "--node",
        topics.peer_bridge_identity(NORTH), "--role", "bridge")  # fmt: skip
    relay = DelayRelay(ports[SOUTH], delay_s)
    stanza = roots[NORTH] / "bridge.conf"
    cli("mosquitto", "bridge", "--policy", roots[NORTH] / "policy.toml", "--peer", SOUTH,
        "--address", f"127.0.0.1:{relay.port}", "--peer-ca", bridge / "ca.pem",
        "--cert", bridge / "node.pem", "--key", bridge / "node.key", "--out", stanza)  # fmt: skip
    for folder in roots.values():
        (folder / "mq").mkdir()
    with ExitStack() as stack:
        stack.callback(relay.close)
        south_mq: ServerProcess = stack.enter_context(
            running(start_campus_mosquitto(south.write(), workdir=roots[SOUTH] / "mq"))
        )
        written_north = north.write()
        north_mq = stack.enter_context(
            running(
                start_mosquitto(
                    port=ports[NORTH],
                    workdir=roots[NORTH] / "mq",
                    tls=written_north.listener_tls(),
                    probe=written_north.client_context(),
                    extra_config=tuple(stanza.read_text().splitlines()),
                )
            )
        )
        south.servers["mosquitto"], north.servers["mosquitto"] = south_mq, north_mq
        stack.callback(south.stop)
        south.start()
        stack.callback(north.stop)
        north.start()
        yield TwoCampuses(north, south, relay)
