"""The effective configuration of a node, each value with where it came from.

The values are exactly what :func:`sluicegate.config.load_settings` gives a node started
with the same file and environment (the environment beats the file, the file beats the
defaults); this module only works out, key by key, which of the three supplied it. Secrets
(the MQTT password, a password inside a URL) never leave here unmasked. It reads the file
and the environment and nothing else.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, SecretStr

from sluicegate.config import ENV_PREFIX, Settings, load_settings
from sluicegate.errors import ConfigError

MASK = "********"
DEFAULT = "default"
ROLE_SECTIONS: dict[str, tuple[str, ...]] = {
    "edge": ("mqtt", "edge", "offload"),
    "pool": ("mqtt", "pool"),
    "broker": ("mqtt", "broker"),
    "all": tuple(Settings.model_fields),
}


@dataclass(frozen=True)
class Entry:
    """One setting in effect: its value (secrets masked; None when unset) and its source:
    ``default``, the config file's path, or ``env NAME``."""

    section: str
    key: str
    value: Any
    source: str


def _env_sources(environ: Mapping[str, str]) -> dict[tuple[str, str], str]:
    """(section, key) -> the variable that sets it, as pydantic-settings reads them:
    ``SLUICEGATE_<SECTION>__<KEY>``, or a whole section as JSON in ``SLUICEGATE_<SECTION>``
    (names are not case-sensitive)."""
    found: dict[tuple[str, str], str] = {}
    whole: dict[tuple[str, str], str] = {}
    for name, raw in environ.items():
        if not name.upper().startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        if "__" in rest:
            section, key = rest.split("__", 1)
            found[(section, key)] = name
            continue
        try:
            doc = json.loads(raw)
        except ValueError:
            continue  # load_settings has refused it already
        if isinstance(doc, dict):
            whole.update({(rest, str(key).lower()): name for key in doc})
    return whole | found


def _file_keys(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    with path.open("rb") as fh:  # load_settings has read and parsed it already
        return tomllib.load(fh)


def _masked(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return MASK
    if isinstance(value, str) and "://" in value:
        parts = urlsplit(value)
        if parts.password:
            userinfo = f"{parts.username or ''}:{MASK}"
            host = parts.netloc.rsplit("@", 1)[1]
            return urlunsplit(parts._replace(netloc=f"{userinfo}@{host}"))
    return value


def effective(
    path: Path | None, role: str = "all", environ: Mapping[str, str] | None = None
) -> list[Entry]:
    """Every setting of ``role``'s sections in effect with ``path`` and the environment."""
    if role not in ROLE_SECTIONS:
        raise ConfigError(f"unknown role {role!r}; known: {', '.join(ROLE_SECTIONS)}")
    settings = load_settings(path)
    env = _env_sources(os.environ if environ is None else environ)
    data = _file_keys(path)
    entries = []
    for section in ROLE_SECTIONS[role]:
        model = getattr(settings, section)
        assert isinstance(model, BaseModel)
        in_file = data.get(section, {})
        for key in type(model).model_fields:
            if (section, key) in env:
                source = f"env {env[(section, key)]}"
            elif key in in_file:
                source = str(path)
            else:
                source = DEFAULT
            entries.append(Entry(section, key, _masked(getattr(model, key)), source))
    return entries


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def render(entries: Sequence[Entry], path: Path | None) -> str:
    """``entries`` as TOML, each line's source in a comment beside it."""
    where = f"{path} > " if path is not None else ""
    out = [f"# in effect (environment > {where}defaults); secrets masked"]
    rows: list[tuple[str, str]] = []
    section = None
    for e in entries:
        if e.section != section:
            section = e.section
            rows.append(("", ""))
            rows.append((f"[{section}]", ""))
        if e.value is None:
            rows.append((f"# {e.key} is not set", e.source))
        else:
            rows.append((f"{e.key} = {_toml(e.value)}", e.source))
    width = max(len(text) for text, _ in rows)
    for text, source in rows:
        out.append(f"{text:<{width}}  # {source}" if source else text)
    return "\n".join(out) + "\n"
