"""Two sister campuses on this machine for tests: each with its own CA, policy naming the
other under [peers], ACL and secured Mosquitto, and north's Mosquitto bridged to south's the
way their operators do it: south's CA issues north's bridge its key and certificate
(``sluicegate ca issue --role bridge``), north writes the stanza (``sluicegate mosquitto
bridge``) into its configuration. A wiretap identity on each side reads everything, as an
auditor of the bridge would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from policies.loader import parse_policy
from policies.model import Policy
from sluicegate import pki, topics
from sluicegate.acl import render_acl
from sluicegate.app.campus import MOSQUITTO, PROBE, Campus
from sluicegate.app.cli import app
from sluicegate.app.link import DelayRelay
from sluicegate.app.localcampus import start_campus_mosquitto
from sluicegate.app.servers import ServerProcess, free_port, running, start_mosquitto
from sluicegate.enroll.authority import init_folder
from tests.policies.policy_testkit import key, site_doc, to_toml

WIRETAP = "wiretap"  # reads every topic of its campus: what crossed, seen from there


@dataclass
class Site:
    """One campus: its files (as a :class:`Campus`, for the test clients), its policy, its
    CA and its Mosquitto."""

    name: str
    campus: Campus
    policy: Policy
    ca: pki.Authority
    server: ServerProcess | None = None
    relay: DelayRelay | None = None  # the link its bridge crosses, when delayed

    @property
    def broker(self) -> str:
        return f"{self.name}-broker-1"

    def issue(self, identity: str) -> None:
        """A client certificate from this campus's CA for ``identity`` (its published test
        key), beside the campus's files."""
        own = key(identity)
        cert = pki.issue(
            self.ca,
            own.private.public_key(),
            identity,
            purpose="client",
            now=time.time(),
            days=pki.NODE_DAYS,
        )
        self.campus.cert_file(identity).write_bytes(pki.cert_pem(cert))
        key_file = self.campus.root / f"{identity}.key"
        pki.write_private(key_file, own.to_pem())
        self.campus.key_files[identity] = key_file


def write_site(
    root: Path, name: str, peer: str, *, send: dict[str, Any], receive: dict[str, Any]
) -> Site:
    """``name``'s campus files under ``root``: policy, CA, Mosquitto's certificate, the ACL
    (with the wiretap reading everything), its broker's and the wiretap's certificates."""
    root.mkdir(parents=True, exist_ok=True)
    text = to_toml(site_doc(name, peer, send=send, receive=receive))
    policy_file = root / "policy.toml"
    policy_file.write_text(text)
    policy = parse_policy(text.encode(), source=str(policy_file))
    now = time.time()
    ca = init_folder(root, name, now=now)
    server_key, server = pki.server_identity(ca, ("127.0.0.1", "localhost"), now=now)
    pki.write_private(root / f"{MOSQUITTO}.key", pki.key_pem(server_key))
    (root / f"{MOSQUITTO}.pem").write_bytes(pki.cert_pem(server))
    acl = render_acl(policy) + f"\n# the test's wiretap\nuser {WIRETAP}\ntopic read #\n"
    (root / "mosquitto.acl").write_text(acl)
    campus = Campus(root, policy_file, {MOSQUITTO: root / f"{MOSQUITTO}.key"}, free_port())
    site = Site(name, campus, policy, ca)
    for identity in (f"{name}-broker-1", WIRETAP, PROBE):
        site.issue(identity)
    return site


def cli(*args: str | Path) -> str:
    """Run a ``sluicegate`` command; its output, or AssertionError with it."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, (args, result.output, result.exception)
    return result.output


@contextmanager
def bridged_sites(
    root: Path,
    *,
    send: dict[str, Any],
    receive: dict[str, Any] | None = None,
    bridge: bool = True,
    delay_s: float | None = None,
) -> Iterator[tuple[Site, Site]]:
    """north and south, each its Mosquitto running, north's bridged to south's (unless not
    ``bridge``: a test may then log in as the bridge itself). ``send``: what north may send
    south (and south receive); ``receive``: the other way. With ``delay_s`` the bridge
    crosses a :class:`DelayRelay` holding every byte that long each way (``north.relay``)."""
    back = receive or {}
    north = write_site(root / "north", "north-site", "south-site", send=send, receive=back)
    south = write_site(root / "south", "south-site", "north-site", send=back, receive=send)
    # south's CA issues north's bridge its key and certificate; north writes the stanza.
    issued = north.campus.root / "bridge"  # not `bridge`: that says whether it runs
    issued.mkdir()
    cli(
        "ca",
        "issue",
        "--ca-dir",
        south.campus.root,
        "--state-dir",
        issued,
        "--node",
        topics.peer_bridge_identity("north-site"),
        "--role",
        "bridge",
    )
    stanza = north.campus.root / "bridge.conf"
    port = south.campus.mqtt_port
    if delay_s is not None:
        north.relay = DelayRelay(port, delay_s)
        port = north.relay.port
    cli(
        "mosquitto",
        "bridge",
        "--policy",
        north.campus.policy_file,
        "--peer",
        "south-site",
        "--address",
        f"127.0.0.1:{port}",
        "--peer-ca",
        issued / "ca.pem",
        "--cert",
        issued / "node.pem",
        "--key",
        issued / "node.key",
        "--both-ways",  # one bridge, north's, carries both trees
        "--out",
        stanza,
    )
    lines = stanza.read_text().splitlines()
    with ExitStack() as stack:
        if north.relay is not None:
            stack.callback(north.relay.close)
        (south.campus.root / "mq").mkdir()
        south.server = stack.enter_context(
            running(start_campus_mosquitto(south.campus, workdir=south.campus.root / "mq"))
        )
        (north.campus.root / "mq").mkdir()
        north.server = stack.enter_context(
            running(
                start_mosquitto(
                    port=north.campus.mqtt_port,
                    workdir=north.campus.root / "mq",
                    tls=north.campus.listener_tls(),
                    probe=north.campus.client_context(),
                    extra_config=tuple(lines) if bridge else (),
                )
            )
        )
        yield north, south
