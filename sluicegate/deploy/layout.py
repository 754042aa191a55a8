"""Where an installed node's files live, as pure path arithmetic under an install root.

One table for every path the installer writes or enrollment fills: the config in
``/etc/sluicegate``, the unit in ``/etc/systemd/system``, the sysusers entry, and the
node's state directory ``/var/lib/sluicegate/<role>`` (its outbox, key, TLS certificate,
CA and pinned policy). Under a root other than ``/`` every path is inside that root, and
so are the paths written into the config, so a node staged there runs from its config as
it is. This module touches no file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from sluicegate.errors import ConfigError

Role = Literal["edge", "pool", "broker"]
ROLES: tuple[Role, ...] = get_args(Role)

USER = "sluicegate"  # the system user and group every role runs as
UNIT_DIR = Path("etc/systemd/system")
CONFIG_DIR = Path("etc/sluicegate")
SYSUSERS_FILE = Path("usr/lib/sysusers.d/sluicegate.conf")
STATE_ROOT = Path("var/lib/sluicegate")
KEY_NAME = "node.key"  # the node's Ed25519 identity key, also its TLS client key
CERT_NAME = "node.pem"  # its TLS client certificate
CA_NAME = "ca.pem"  # the campus CA that signed the MQTT broker's certificate


def check_role(role: str) -> Role:
    """``role`` as a :data:`Role`, or a ConfigError naming the ones there are."""
    for known in ROLES:
        if role == known:
            return known
    raise ConfigError(f"unknown role {role!r}; known: {', '.join(ROLES)}")


def unit_name(role: Role) -> str:
    return f"sluicegate-{role}.service"


@dataclass(frozen=True)
class NodePaths:
    """Every file of one installed role, as absolute paths on this machine."""

    root: Path
    config: Path
    config_new: Path  # the new config beside an operator-edited one
    unit: Path
    sysusers: Path
    state_dir: Path
    key_file: Path
    cert_file: Path
    ca_file: Path


def state_dir(role: Role, root: Path) -> Path:
    """The state directory of ``role`` under ``root``: ``<root>/var/lib/sluicegate/<role>``."""
    return root / STATE_ROOT / role


def node_paths(role: Role, root: Path) -> NodePaths:
    """The paths of ``role`` installed under ``root`` (absolute; ``/`` for the real system)."""
    if not root.is_absolute():
        raise ConfigError(f"install root {root} must be an absolute path")
    state = state_dir(role, root)
    config = root / CONFIG_DIR / f"{role}.toml"
    return NodePaths(
        root=root,
        config=config,
        config_new=config.with_name(f"{role}.toml.new"),
        unit=root / UNIT_DIR / unit_name(role),
        sysusers=root / SYSUSERS_FILE,
        state_dir=state,
        key_file=state / KEY_NAME,
        cert_file=state / CERT_NAME,
        ca_file=state / CA_NAME,
    )
