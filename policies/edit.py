"""Editing a policy file the way an officer would by hand: add a node or an app, raise the
version, keep every comment and the layout (``tomlkit`` round-trips TOML text).

Pure text in, text out: :func:`add_node` returns the new file's text, or a
``PolicyParseError`` naming what is wrong (an unknown pool, a node already listed, a
result that would not load). Signing is the caller's (``policies.signing``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import tomlkit
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import InlineTable, Table

from policies.errors import PolicyParseError
from policies.keys import parse_public_key, public_key_text
from policies.loader import parse_policy
from policies.model import Policy
from policies.sealing import decode_seal_key, seal_key_text

Kind = Literal["edge", "worker", "broker", "app"]


def _fresh(
    parent: tomlkit.TOMLDocument | Table | InlineTable, *, super_table: bool = False
) -> Table | InlineTable:
    """A new table for ``parent``: inline inside an inline table (TOML allows no other)."""
    if isinstance(parent, InlineTable):
        return tomlkit.inline_table()
    return tomlkit.table(is_super_table=super_table)


def _table(doc: tomlkit.TOMLDocument, *path: str) -> Table | InlineTable:
    """The table at ``path``, made if missing (the policy loaded, so what exists is one,
    spelt as a section or inline)."""
    node: tomlkit.TOMLDocument | Table | InlineTable = doc
    for name in path:
        if name not in node:
            node[name] = _fresh(node, super_table=len(path) > 1 and name == path[0])
        node = node[name]
    assert isinstance(node, Table | InlineTable)
    return node


def _key(text: str | None, what: str) -> str:
    if text is None:
        raise PolicyParseError(
            f"adding {what} needs its key (ed25519:…, from 'sluicegate enroll list')",
            source="--key",
        )
    return public_key_text(parse_public_key(text))


def add_node(
    text: str,
    kind: Kind,
    node_id: str,
    *,
    key: str | None = None,
    zone: str | None = None,
    pool: str | None = None,
    edges: Sequence[str] = (),
    results: Sequence[str] = (),
    encryption_key: str | None = None,
    source: str = "policy",
) -> tuple[str, Policy]:
    """The policy text with ``node_id`` added as ``kind`` and the version raised by one,
    and the policy it loads as. ``encryption_key``: a worker's sealing key (``x25519:…``,
    from 'sluicegate pool seal-key new'), listed under its pool's ``encryption_keys``."""
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise PolicyParseError(f"not valid TOML: {exc}", source=source) from exc
    old = parse_policy(text, source=source)
    listed = {e.edge_id for e in old.edges} | set(old.workers) | {r.key_id for r in old.brokers}
    listed |= {a.app_id for a in old.apps}
    if node_id in listed:
        raise PolicyParseError(f"{node_id!r} is already listed in v{old.version}", source=source)
    if encryption_key is not None and kind != "worker":
        raise PolicyParseError("only a worker has an encryption key", source="--encryption-key")
    if kind == "edge":
        if zone is None:
            raise PolicyParseError("adding an edge needs its zone", source="--zone")
        edges_table = _table(doc, "edges")
        entry = _fresh(edges_table)
        entry["zone"] = zone
        entry["key"] = _key(key, f"edge {node_id!r}")
        edges_table[node_id] = entry
    elif kind == "worker":
        if pool is None:
            raise PolicyParseError("adding a worker needs its pool", source="--pool")
        pools = _table(doc, "pools")
        if pool not in pools:
            if zone is None:
                known = ", ".join(p.name for p in old.pools) or "none"
                raise PolicyParseError(
                    f"no pool {pool!r} (known: {known}); give --zone to create it",
                    source="--pool",
                )
            fresh = _fresh(pools)
            fresh["zone"] = zone
            fresh["workers"] = tomlkit.inline_table()
            pools[pool] = fresh
        workers = pools[pool]["workers"]
        workers[node_id] = _key(key, f"worker {node_id!r}")
        if encryption_key is not None:
            try:
                sealing = seal_key_text(decode_seal_key(encryption_key))
            except ValueError as exc:
                raise PolicyParseError(str(exc), source="--encryption-key") from exc
            held = pools[pool]
            if "encryption_keys" not in held:
                held["encryption_keys"] = _fresh(held)
            held["encryption_keys"][node_id] = [sealing]
    elif kind == "broker":
        _table(doc, "broker_signers", "keys")[node_id] = _key(key, f"broker {node_id!r}")
    else:
        if not edges:
            raise PolicyParseError(
                "adding an app needs the edges it submits to", source="--app-edge"
            )
        apps_table = _table(doc, "apps")
        entry = _fresh(apps_table)
        entry["edges"] = list(edges)
        if results:
            entry["results"] = list(results)
        apps_table[node_id] = entry
    doc["version"] = old.version + 1
    new_text = tomlkit.dumps(doc)
    return new_text, parse_policy(new_text, source=source)
