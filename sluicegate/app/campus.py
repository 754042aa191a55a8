"""A small campus written to disk: signed policy, keys, certificates, the Mosquitto ACL
and one settings file per node (and one for the observer).

The demo runs on it, and so do the tests that start a broker, edges and workers as real
processes. Keys come from a function the caller passes: fresh random keys for the demo
(no private key is ever a shipped default), the published test keys in tests. The layout
is two inspection lines and a data centre in one fab, and an off-site cloud pool: wafer
images stay on campus and travel sealed to the chosen worker's key (the class is
confidential; each worker's sealing key is made in its state folder and listed in the
policy), OCR crops may go off-site.

Secure by default, as a plant runs it: a campus CA made for the run, a TLS client
certificate per node (its own Ed25519 key, the one the policy lists), per app and per
observer, a server certificate for Mosquitto on loopback, and the ACL generated from the
policy; every node config points at its own certificate. ``secure=False`` writes the open
layout (no TLS, anonymous MQTT) for debugging only.
"""

from __future__ import annotations

import datetime as dt
import ssl
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from broker.console.auth import ROLES, add_entry, new_token, token_digest
from center_pool.seal_keys import KeyFolder, folder_of
from policies import SigningKey, parse_policy
from policies.signing import add_signature, dump_signatures, sign_policy
from sluicegate import pki
from sluicegate.acl import render_acl
from sluicegate.config import MqttSettings
from sluicegate.enroll.authority import Authority, init_folder
from sluicegate.mosquitto import ListenerTls

FAB = "campus/fab-north"
LINES = {"line-1-pc": f"{FAB}/line-1", "line-2-pc": f"{FAB}/line-2"}
WORKERS = {
    "north-cpu-1": (f"{FAB}/dc", "x86-cpu-dc"),
    "cloud-cpu-1": ("offsite/cloud-east", "x86-cpu-cloud"),
}
OFFICER, BROKER = "officer", "broker-1"
# Vision apps (each its own MQTT identity): one per line, one that may submit to both.
APPS = {
    "app-line-1": (("line-1-pc",), "app/line-1"),
    "app-line-2": (("line-2-pc",), "app/line-2"),
    "app-campus": (tuple(LINES), "app/campus"),
}
APP_OF_LINE = {"line-1-pc": "app-line-1", "line-2-pc": "app-line-2"}
OBSERVER = "observer"  # reads status, telemetry, job records: watchers, the twin's recorder
PROBE = "sg-probe"  # no rights at all: Mosquitto's readiness ping
MOSQUITTO = "mosquitto"  # the server certificate's file stem

POLICY_TEMPLATE = """\
# Sluicegate demo campus, written by sluicegate.app.campus with keys made for this run.
format = "sluicegate-policy/1"
campus = "{campus}"
version = {version}
expires = {expires}
description = "Two inspection lines and a data centre on campus; an off-site cloud pool"

[policy_signers]
threshold = 1
keys = {{ {officer} = "{officer_key}" }}

[broker_signers.keys]
{broker} = "{broker_key}"

[zones]
"{fab}/line-1" = "Fab North, inspection line 1"
"{fab}/line-2" = "Fab North, inspection line 2"
"{fab}/dc" = "Fab North data centre"
"offsite/cloud-east" = "Rented cloud capacity, outside the campus"

{pools}
[edges.line-1-pc]
zone = "{fab}/line-1"
key = "{line1_key}"

[edges.line-2-pc]
zone = "{fab}/line-2"
key = "{line2_key}"

{apps}
[classes.wafer-image]
description = "Raw wafer inspection images: campus only, sealed to the chosen worker"
{wafer_confidential}allow = ["campus/**"]
deny = ["offsite/**"]

[classes.part-image]
description = "Images of machined metal parts, no process data: may go off-site"
{part_confidential}allow = ["campus/**", "campus/** -> offsite/cloud-east"]

[classes.ocr-crop]
description = "Generic OCR crops of carrier labels: may go off-site"
{ocr_confidential}allow = ["campus/**", "campus/** -> offsite/cloud-east"]

[[subhealth]]
name = "memory-bound"
when = [
  {{ metric = "utilisation", op = ">=", value = 0.7 }},
  {{ metric = "memory_bandwidth", op = ">=", value = 0.9 }},
]

[[subhealth]]
name = "overheating"
when = [{{ metric = "temperature_c", op = ">=", value = 85 }}]

[tokens]
max_ttl_s = 60
max_skew_s = 5
"""


@dataclass(frozen=True)
class Campus:
    """Where everything was written."""

    root: Path
    policy_file: Path
    key_files: dict[str, Path] = field(default_factory=dict)
    mqtt_port: int = 1883
    secure: bool = True
    # Each worker's sealing key (x25519: text), made in its state folder, listed in the policy.
    seal_keys: dict[str, str] = field(default_factory=dict)

    def node_config(self, node: str) -> Path:
        return self.root / f"{node}.toml"

    @property
    def ca_file(self) -> Path:
        return self.root / pki.CA_CERT

    @property
    def acl_file(self) -> Path:
        return self.root / "mosquitto.acl"

    def cert_file(self, identity: str) -> Path:
        return self.root / f"{identity}.pem"

    def console_token(self, role: str = "operator") -> str:
        """The bearer token of the console's ``operator`` or ``viewer`` (written with the
        campus; ``Authorization: Bearer <token>`` on the broker's HTTP views)."""
        return (self.root / f"console-{role}.token").read_text().strip()

    def mqtt(self, identity: str) -> MqttSettings:
        """How ``identity`` (a node, app or observer) reaches this campus's Mosquitto."""
        if not self.secure:
            return MqttSettings(port=self.mqtt_port, plaintext=True)
        return MqttSettings(
            port=self.mqtt_port,
            tls_ca_file=self.ca_file,
            tls_cert_file=self.cert_file(identity),
            tls_key_file=self.key_files[identity],
        )

    def listener_tls(self) -> ListenerTls:
        """What Mosquitto needs to serve this campus (``servers.start_mosquitto(tls=...)``)."""
        return ListenerTls(
            cafile=self.ca_file,
            certfile=self.cert_file(MOSQUITTO),
            keyfile=self.key_files[MOSQUITTO],
            acl_file=self.acl_file,
        )

    def client_context(self, identity: str = PROBE) -> ssl.SSLContext:
        """A TLS client context as ``identity`` (the readiness probe by default)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(self.cert_file(identity), self.key_files[identity])
        return context


AppSpec = tuple[tuple[str, ...], str]  # the edges an app submits to, its results prefix


def _app_tables(apps: Mapping[str, AppSpec]) -> str:
    out = []
    for app, (edges, prefix) in apps.items():
        names = ", ".join(f'"{edge}"' for edge in edges)
        out.append(f'[apps.{app}]\nedges = [{names}]\nresults = ["{prefix}"]\n')
    return "\n".join(out)


def _write_pki(root: Path, keys: dict[str, SigningKey], now: float, campus: str) -> dict[str, Path]:
    """The campus CA (with its join-token key: ``root`` is an enrollment authority folder
    the broker serves; one already there is kept, e.g. made first so that a sister campus's
    policy can pin its fingerprint), Mosquitto's server certificate and one client
    certificate per identity in ``keys``; returns the key files written besides the node
    keys."""
    made = (root / pki.CA_KEY).exists()
    ca = Authority(root).ca if made else init_folder(root, campus, now=now)
    server_key, server = pki.server_identity(ca, ("127.0.0.1", "localhost"), now=now)
    key_file = root / f"{MOSQUITTO}.key"
    pki.write_private(key_file, pki.key_pem(server_key))
    (root / f"{MOSQUITTO}.pem").write_bytes(pki.cert_pem(server))
    for name, key in keys.items():
        cert = pki.issue(
            ca, key.private.public_key(), name, purpose="client", now=now, days=pki.NODE_DAYS
        )
        (root / f"{name}.pem").write_bytes(pki.cert_pem(cert))
    return {MOSQUITTO: key_file}


def write_campus(
    root: Path,
    key_for: Callable[[str], SigningKey],
    *,
    mqtt_port: int,
    redis_url: str,
    version: int = 1,
    now: float | None = None,
    workers: dict[str, tuple[str, str]] | None = None,
    http_port: int = 0,
    secure: bool = True,
    apps: Mapping[str, AppSpec] | None = None,
    rollout: str = "",
    confidential: bool = True,
    campus: str = "demo-campus",
    fab: str = FAB,
    peers: str = "",
    also_confidential: Collection[str] = (),
) -> Campus:
    """Write the policy (signed by the officer), node keys and node configs under ``root``;
    with ``secure``, also the CA, every identity's certificate and the Mosquitto ACL.
    ``apps``: the vision apps the policy lists (default :data:`APPS`); ``rollout``: a
    ``[rollout]`` table (TOML) for the policy, none by default; ``confidential``: wafer
    images travel only sealed (the default; off for tests whose workers are played by hand
    and hold no key). ``campus`` names it and ``fab`` is the zone its lines and data centre
    are under (a sister campus is another fab: ``campus/fab-south``); ``peers``: its
    ``[peers]`` tables (TOML), none by default; ``also_confidential``: ``part-image`` or
    ``ocr-crop``, to travel only sealed too."""
    apps = APPS if apps is None else apps
    lines = {edge: zone.replace(FAB, fab, 1) for edge, zone in LINES.items()}
    root.mkdir(parents=True, exist_ok=True)
    now_s = now if now is not None else dt.datetime.now(dt.UTC).timestamp()
    stamp = dt.datetime.fromtimestamp(now, dt.UTC) if now is not None else dt.datetime.now(dt.UTC)
    expires = (stamp + dt.timedelta(days=30)).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")
    workers = (
        {w: (zone.replace(FAB, fab, 1), device) for w, (zone, device) in WORKERS.items()}
        if workers is None
        else workers
    )
    names = [OFFICER, BROKER, *LINES, *workers]
    by_zone: dict[str, list[str]] = {}
    for worker, (zone, _device_class) in workers.items():
        by_zone.setdefault(zone, []).append(worker)
    keys = {name: key_for(name) for name in names}
    # Each worker's sealing key, made in its state folder as 'pool run' would make it.
    sealing = {
        w: KeyFolder(folder_of(root / "state" / w)).create(now_s).key.public_text for w in workers
    }
    pools = "".join(
        f'[pools.{zone.replace("/", "-")}]\nzone = "{zone}"\nworkers = {{ '
        + ", ".join(f'{w} = "{keys[w].public_text}"' for w in sorted(ids))
        + " }\nencryption_keys = { "
        + ", ".join(f'{w} = ["{sealing[w]}"]' for w in sorted(ids))
        + " }\n\n"
        for zone, ids in sorted(by_zone.items())
    )
    if secure:  # apps and observers have keys for their certificates only
        keys |= {name: key_for(name) for name in (*apps, OBSERVER, PROBE)}
    key_files: dict[str, Path] = {}
    for name, key in keys.items():
        path = root / f"{name}.key"
        path.write_bytes(key.to_pem())
        path.chmod(0o600)
        key_files[name] = path
    text = POLICY_TEMPLATE.format(
        version=version,
        expires=expires,
        campus=campus,
        officer=OFFICER,
        officer_key=keys[OFFICER].public_text,
        broker=BROKER,
        broker_key=keys[BROKER].public_text,
        fab=fab,
        line1_key=keys["line-1-pc"].public_text,
        line2_key=keys["line-2-pc"].public_text,
        pools=pools,
        apps=_app_tables(apps),
        wafer_confidential="confidential = true\n" if confidential else "",
        part_confidential="confidential = true\n" if "part-image" in also_confidential else "",
        ocr_confidential="confidential = true\n" if "ocr-crop" in also_confidential else "",
    ) + "".join(f"\n{table}" for table in (rollout, peers) if table)
    policy_file = root / "policy.toml"
    policy_file.write_text(text)
    policy = parse_policy(text.encode(), source=str(policy_file))
    bundle = add_signature(None, policy, sign_policy(policy, keys[OFFICER], OFFICER))
    policy_file.with_name("policy.toml.sig").write_bytes(dump_signatures(bundle))
    if secure:
        nodes = {n: k for n, k in keys.items() if n != OFFICER}
        key_files |= _write_pki(root, nodes, now_s, campus)
        (root / "mosquitto.acl").write_text(render_acl(policy, observers=(OBSERVER,)))
    written = Campus(root, policy_file, key_files, mqtt_port, secure, sealing)

    def mqtt(node: str) -> str:
        text = f"[mqtt]\nport = {mqtt_port}\nkeepalive_s = 5\nreconnect_max_s = 2\n"
        if not secure:
            return text + "plaintext = true\n"
        return (
            text
            + f'tls_ca_file = "{written.ca_file}"\ntls_cert_file = "{written.cert_file(node)}"\n'
            f'tls_key_file = "{key_files[node]}"\n'
        )

    ca_dir = f'ca_dir = "{root}"\n' if secure else ""
    users = write_console_users(root)
    (root / f"{BROKER}.toml").write_text(
        mqtt(BROKER)
        + f'\n[broker]\nid = "{BROKER}"\nredis_url = "{redis_url}"\nhttp_port = {http_port}\n'
        f'key_file = "{key_files[BROKER]}"\npolicy_file = "{policy_file}"\n'
        f'state_dir = "{root / "state" / BROKER}"\n{ca_dir}'
        f'\n[console]\nusers_file = "{users}"\n'
    )
    for edge, zone in lines.items():
        # A line PC is modest: one job at a time, and more than a few waiting is a burst.
        written.node_config(edge).write_text(
            mqtt(edge) + f'\n[edge]\nid = "{edge}"\nzone = "{zone}"\nconcurrency = 1\n'
            f'key_file = "{key_files[edge]}"\n'
            f"\n[offload]\nqueue_bound = 4\n"
            f'state_dir = "{root / "state" / edge}"\npolicy_file = "{policy_file}"\n'
        )
    # The observer's: what 'sluicegate twin record --config observer.toml' connects with.
    written.node_config(OBSERVER).write_text(mqtt(OBSERVER))
    for worker, (zone, device_class) in workers.items():
        written.node_config(worker).write_text(
            mqtt(worker)
            + f'\n[pool]\nid = "{worker}"\nzone = "{zone}"\ndevice_class = "{device_class}"\n'
            f'redis_url = "{redis_url}"\nkey_file = "{key_files[worker]}"\n'
            f'state_dir = "{root / "state" / worker}"\npolicy_file = "{policy_file}"\n'
        )
    return written


def write_console_users(root: Path) -> Path:
    """The console's users for a local campus: an operator and a viewer, by token (each
    token in ``console-<role>.token`` beside the campus, read by :meth:`Campus.console_token`)."""
    users = root / "console-users.toml"
    for role in ROLES:
        token = new_token()
        (root / f"console-{role}.token").write_text(token + "\n")
        (root / f"console-{role}.token").chmod(0o600)
        add_entry(users, "token", role, role, token_digest(token))
    return users
