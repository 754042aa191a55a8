"""A small campus written to disk: signed policy, keys and one settings file per node.

The demo runs on it, and so do the tests that start a broker, edges and workers as real
processes. Keys come from a function the caller passes: fresh random keys for the demo
(no private key is ever a shipped default), the published test keys in tests. The layout
is two inspection lines and a data centre in one fab, and an off-site cloud pool: wafer
images stay on campus, OCR crops may go off-site.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from policies import SigningKey, parse_policy
from policies.signing import add_signature, dump_signatures, sign_policy

FAB = "campus/fab-north"
LINES = {"line-1-pc": f"{FAB}/line-1", "line-2-pc": f"{FAB}/line-2"}
WORKERS = {
    "north-cpu-1": (f"{FAB}/dc", "x86-cpu-dc"),
    "cloud-cpu-1": ("offsite/cloud-east", "x86-cpu-cloud"),
}
OFFICER, BROKER = "officer", "broker-1"

POLICY_TEMPLATE = """\
# Sluicegate demo campus, written by sluicegate.campus with keys made for this run.
format = "sluicegate-policy/1"
campus = "demo-campus"
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

[classes.wafer-image]
description = "Raw wafer inspection images: campus only"
allow = ["campus/**"]
deny = ["offsite/**"]

[classes.ocr-crop]
description = "Generic OCR crops of carrier labels: may go off-site"
allow = ["campus/**", "campus/** -> offsite/cloud-east"]

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

    def node_config(self, node: str) -> Path:
        return self.root / f"{node}.toml"


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
) -> Campus:
    """Write the policy (signed by the officer), node keys and node configs under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.fromtimestamp(now, dt.UTC) if now is not None else dt.datetime.now(dt.UTC)
    expires = (stamp + dt.timedelta(days=30)).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")
    workers = WORKERS if workers is None else workers
    names = [OFFICER, BROKER, *LINES, *workers]
    by_zone: dict[str, list[str]] = {}
    for worker, (zone, _device_class) in workers.items():
        by_zone.setdefault(zone, []).append(worker)
    pools = "".join(
        f'[pools.{zone.replace("/", "-")}]\nzone = "{zone}"\nworkers = {sorted(ids)!r}\n\n'.replace(
            "'", '"'
        )
        for zone, ids in sorted(by_zone.items())
    )
    keys = {name: key_for(name) for name in names}
    key_files: dict[str, Path] = {}
    for name, key in keys.items():
        path = root / f"{name}.key"
        path.write_bytes(key.to_pem())
        path.chmod(0o600)
        key_files[name] = path
    text = POLICY_TEMPLATE.format(
        version=version,
        expires=expires,
        officer=OFFICER,
        officer_key=keys[OFFICER].public_text,
        broker=BROKER,
        broker_key=keys[BROKER].public_text,
        fab=FAB,
        line1_key=keys["line-1-pc"].public_text,
        line2_key=keys["line-2-pc"].public_text,
        pools=pools,
    )
    policy_file = root / "policy.toml"
    policy_file.write_text(text)
    policy = parse_policy(text.encode(), source=str(policy_file))
    bundle = add_signature(None, policy, sign_policy(policy, keys[OFFICER], OFFICER))
    policy_file.with_name("policy.toml.sig").write_bytes(dump_signatures(bundle))
    campus = Campus(root, policy_file, key_files)
    mqtt = f"[mqtt]\nport = {mqtt_port}\nkeepalive_s = 5\nreconnect_max_s = 2\n"
    (root / f"{BROKER}.toml").write_text(
        mqtt + f'\n[broker]\nid = "{BROKER}"\nredis_url = "{redis_url}"\nhttp_port = {http_port}\n'
        f'key_file = "{key_files[BROKER]}"\npolicy_file = "{policy_file}"\n'
        f'state_dir = "{root / "state" / BROKER}"\n'
    )
    for edge, zone in LINES.items():
        # A line PC is modest: one job at a time, and more than a few waiting is a burst.
        campus.node_config(edge).write_text(
            mqtt + f'\n[edge]\nid = "{edge}"\nzone = "{zone}"\nconcurrency = 1\n'
            f"\n[offload]\nqueue_bound = 4\n"
            f'state_dir = "{root / "state" / edge}"\npolicy_file = "{policy_file}"\n'
        )
    for worker, (zone, device_class) in workers.items():
        campus.node_config(worker).write_text(
            mqtt + f'\n[pool]\nid = "{worker}"\nzone = "{zone}"\ndevice_class = "{device_class}"\n'
            f'redis_url = "{redis_url}"\nkey_file = "{key_files[worker]}"\n'
            f'state_dir = "{root / "state" / worker}"\npolicy_file = "{policy_file}"\n'
        )
    return campus
