"""A role's config file, made from its commented template with the installer's values.

The templates (``templates/<role>.toml``, package data) are valid configs as shipped, every
key documented. Filling one rewrites only the lines of the keys it sets, so the comments
stay: a set key's line gets the new value (uncommented if it was commented out), an unset
one is commented out. The rendered file opens with a checksum of the rest, which is how
the installer tells its own file from one an operator edited; that it must never
overwrite. No file is written here; reading the template is the only I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ValidationError

from sluicegate import topics
from sluicegate.config import (
    BrokerSettings,
    ConsoleSettings,
    EdgeSettings,
    MqttSettings,
    OffloadSettings,
    PoolSettings,
)
from sluicegate.deploy.layout import CONFIG_DIR, NodePaths, Role
from sluicegate.errors import ConfigError

Value = str | int | bool | Path | None  # None: comment the key out
Values = Mapping[str, Mapping[str, Value]]  # section -> key -> value

SECTIONS: dict[Role, tuple[str, ...]] = {
    "edge": ("mqtt", "edge", "offload"),
    "pool": ("mqtt", "pool"),
    "broker": ("mqtt", "broker", "console"),
}
MODELS: dict[str, type[BaseModel]] = {
    "mqtt": MqttSettings,
    "edge": EdgeSettings,
    "offload": OffloadSettings,
    "pool": PoolSettings,
    "broker": BrokerSettings,
    "console": ConsoleSettings,
}
TLS_PORT, PLAINTEXT_PORT = 8883, 1883
_CHECKSUM = re.compile(r"# sluicegate-install sha256 ([0-9a-f]{64})\n")
_SECTION = re.compile(r"\[([A-Za-z0-9_]+)\]\s*")
_KEY = re.compile(r"(# )?([A-Za-z_][A-Za-z0-9_]*) = .*")


@dataclass(frozen=True)
class NodeValues:
    """What the installer (or enrollment) writes into a role's config."""

    id: str | None = None  # required for edge and pool; a broker defaults to broker-1
    zone: str | None = None  # edge and pool only
    mqtt_host: str | None = None  # None: the template's 127.0.0.1
    mqtt_port: int | None = None  # None: 8883 (TLS), or 1883 with plaintext
    models_dir: Path | None = None  # None: the installer's default models folder
    # Connect without TLS: for debugging on a trusted machine only. The TLS keys are then
    # commented out.
    plaintext: bool = False


def template_text(role: Role) -> str:
    """The commented template of ``role`` as it ships."""
    return (resources.files("sluicegate.deploy") / "templates" / f"{role}.toml").read_text()


def _toml(value: str | int | bool | Path) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a TOML basic string


def fill(text: str, values: Values) -> str:
    """``text`` (a template) with each ``values[section][key]`` set, or commented out for
    None. Every key must be in the template, in its section, exactly once."""
    todo = {(section, key) for section, keys in values.items() for key in keys}
    out: list[str] = []
    section = ""
    for line in text.splitlines(keepends=True):
        head = _SECTION.fullmatch(line)
        if head:
            section = head.group(1)
        key_line = _KEY.fullmatch(line.rstrip("\n"))
        if key_line and key_line.group(2) in values.get(section, {}):
            key = key_line.group(2)
            if (section, key) not in todo:
                raise ValueError(f"template sets [{section}] {key} twice")
            todo.discard((section, key))
            value = values[section][key]
            if value is None:
                line = line if key_line.group(1) else f"# {line}"
            else:
                line = f"{key} = {_toml(value)}\n"
        out.append(line)
    if todo:
        missing = ", ".join(f"[{s}] {k}" for s, k in sorted(todo))
        raise ValueError(f"template has no line for {missing}")
    return "".join(out)


def config_values(role: Role, values: NodeValues, paths: NodePaths, models_dir: Path) -> Values:
    """The template keys the installer sets for ``role`` installed at ``paths``."""
    if role != "broker" and not (values.id and values.zone):
        kind = "an edge" if role == "edge" else "a pool worker"
        raise ConfigError(f"{kind} needs its id and zone: give --id and --zone")
    if role == "broker" and values.zone is not None:
        raise ConfigError("a broker has no zone; leave out --zone")
    node_id = values.id or "broker-1"
    try:
        topics.check_id(f"{role} id", node_id)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    port = values.mqtt_port
    if port is None:
        port = PLAINTEXT_PORT if values.plaintext else TLS_PORT
    tls = {
        "tls_ca_file": paths.ca_file,
        "tls_cert_file": paths.cert_file,
        "tls_key_file": paths.key_file,
    }
    mqtt: dict[str, Value] = {"host": values.mqtt_host or "127.0.0.1", "port": port}
    for key, path in tls.items():
        mqtt[key] = None if values.plaintext else path
    mqtt["plaintext"] = values.plaintext
    node: dict[str, Value] = {"id": node_id, "models_dir": models_dir, "key_file": paths.key_file}
    if role == "edge":
        node["zone"] = values.zone
        return {"mqtt": mqtt, "edge": node, "offload": {"state_dir": paths.state_dir}}
    node["state_dir"] = paths.state_dir
    if role == "pool":
        node["zone"] = values.zone
    else:
        node["policy_file"] = paths.root / CONFIG_DIR / "policy.toml"
    return {"mqtt": mqtt, role: node}


def validate(role: Role, text: str, source: str) -> None:
    """Raise ConfigError unless ``text`` is a valid config of ``role``'s sections (the
    environment is not consulted: this checks the file alone)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}") from exc
    for section in SECTIONS[role]:
        try:
            MODELS[section](**data.get(section, {}))
        except ValidationError as exc:
            problems = "; ".join(
                f"[{section}] {'.'.join(str(p) for p in e['loc'])}: {e['msg']} "
                f"(got {e.get('input')!r})"
                for e in exc.errors()
            )
            raise ConfigError(f"invalid configuration for {source}: {problems}") from None


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def render_config(role: Role, values: NodeValues, paths: NodePaths, models_dir: Path) -> str:
    """The config file of ``role``: its filled template under a checksum line."""
    body = fill(template_text(role), config_values(role, values, paths, models_dir))
    validate(role, body, f"the {role} config for {paths.config}")
    return f"# sluicegate-install sha256 {_digest(body)}\n{body}"


def is_pristine(text: str) -> bool:
    """Whether ``text`` is a config file as the installer wrote it (not edited since)."""
    head = _CHECKSUM.match(text)
    return head is not None and head.group(1) == _digest(text[head.end() :])
