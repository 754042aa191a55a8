"""The Mosquitto configuration a campus needs, as text: one TLS listener, the generated ACL,
and a bridge to each sister campus.

Secure by default: clients must present a certificate from the campus CA; its CN becomes
the username (``use_identity_as_username``) and the client id (``use_username_as_clientid``,
so no client can take over another's session by naming its client id, and a second process
with the same identity takes over the first's: see ``sluicegate.fencing``); anonymous clients
are refused; the ACL is ``sluicegate policy acl``'s. ``set_tcp_nodelay true`` is not
optional: a stock Mosquitto delays small packets by Nagle's algorithm, ~40 ms a request
(``sluicegate doctor`` finds it).

A bridge (:func:`bridge_lines`) is Mosquitto's own: TLS 1.3 with the peer campus's CA as its
trust and a certificate that CA issued to this campus's bridge, and only the two ``peer/``
trees of the pair (``sluicegate.topics.peer_tree``): what this campus says to the peer out,
what the peer says to it in. One side of a pair runs it; the other's ACL holds its rights.
It speaks MQTT 3.1.1 by default: a Mosquitto bridge before 2.0.14 sends an MQTT v5 CONNECT
the remote refuses as a protocol error (seen with 2.0.11), so every message between campuses
carries what it needs in its payload and no property has to cross. Pure: returns text,
writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluicegate import topics


@dataclass(frozen=True)
class ListenerTls:
    """Where Mosquitto finds the campus CA, its own certificate and key, and the ACL."""

    cafile: Path
    certfile: Path
    keyfile: Path
    acl_file: Path


def secure_listener(port: int, bind: str, tls: ListenerTls) -> list[str]:
    """The lines of an authenticated TLS listener and its access control."""
    return [
        "per_listener_settings false",
        "allow_anonymous false",
        f"acl_file {tls.acl_file}",
        f"listener {port} {bind}",
        f"cafile {tls.cafile}",
        f"certfile {tls.certfile}",
        f"keyfile {tls.keyfile}",
        "tls_version tlsv1.3",
        "require_certificate true",
        "use_identity_as_username true",
        "use_username_as_clientid true",
    ]


def plant_config(
    tls: ListenerTls,
    *,
    port: int = 8883,
    bind: str = "0.0.0.0",
    persistence_dir: Path = Path("/var/lib/mosquitto"),
    user: str = "mosquitto",
) -> str:
    """A complete ``mosquitto.conf`` for a plant's campus broker. Mosquitto started as root
    drops to ``user``, which must read the CA, certificate, key and ACL and write the
    persistence folder; it logs to stderr (the journal under systemd)."""
    lines = [
        "# Mosquitto for a Sluicegate campus, written by 'sluicegate mosquitto config'.",
        "# Reload the ACL after each policy change: regenerate it, then send SIGHUP.",
        f"# Runs as {user}: it must read the files below and write {persistence_dir}/.",
        f"user {user}",
        *secure_listener(port, bind, tls),
        "set_tcp_nodelay true",
        "persistence true",
        f"persistence_location {persistence_dir}/",
        "autosave_interval 1",
        "max_queued_messages 100000",
        "max_inflight_messages 0",
        "queue_qos0_messages false",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class BridgeTls:
    """What this campus's bridge needs to reach a peer's Mosquitto: the peer campus's CA
    certificate, and the certificate and key that CA issued to this campus's bridge (CN
    ``peer.<this campus>``)."""

    cafile: Path
    certfile: Path
    keyfile: Path


def bridge_lines(
    campus: str,
    peer: str,
    address: str,
    tls: BridgeTls,
    *,
    protocol: str = "mqttv311",
    pull: bool = False,
) -> list[str]:
    """The ``connection`` stanza of the bridge from ``campus``'s Mosquitto to ``peer``'s at
    ``address`` (``host:port``): QoS 1 both ways, a persistent session (what a link cut
    holds back is delivered once it is back), announced as a bridge (retained messages keep
    their flag across), its state (``1`` connected, ``0`` lost: retained) told to this
    campus's own Mosquitto only, on ``topics.bridge_state``, and nothing but the pair's two
    trees.
    ``protocol``: ``mqttv50`` where both Mosquittos are 2.0.14 or later. With ``pull``,
    only what ``peer`` says to ``campus`` comes in, and the peer runs the mirror bridge: so
    every message crosses on a connection the sending Mosquitto accepted, where its
    ``set_tcp_nodelay`` holds (Mosquitto 2.0.11 leaves Nagle on for a bridge's own
    connection: a small message behind an unacknowledged one waits for the far side's
    delayed ACK, up to 40 ms)."""
    out_line = [] if pull else [f"topic {topics.peer_tree(campus, peer)} out 1"]
    return [
        f"connection sluicegate-{campus}-to-{peer}",
        f"address {address}",
        f"bridge_protocol_version {protocol}",
        f"remote_clientid {topics.peer_bridge_identity(campus)}",
        "cleansession false",
        "notifications true",
        "notifications_local_only true",
        f"notification_topic {topics.bridge_state(peer)}",
        "try_private true",
        "start_type automatic",
        "restart_timeout 1 10",
        "keepalive_interval 10",
        f"bridge_cafile {tls.cafile}",
        f"bridge_certfile {tls.certfile}",
        f"bridge_keyfile {tls.keyfile}",
        "bridge_tls_version tlsv1.3",
        "bridge_insecure false",
        *out_line,
        f"topic {topics.peer_tree(peer, campus)} in 1",
    ]
