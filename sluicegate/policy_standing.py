"""What a signed policy says of the node reading it, in words an operator can act on: an
edge or a pool worker the policy does not list gets no placement (the broker takes every
node's zone and key from the policy, never from the node), one listed in another zone than
its configuration says is placed by the policy's zone, and one listed with another key than
its own has its signed records refused. Each finding carries the fix.

:func:`standing` is pure; ``sluicegate doctor`` reports what it finds as a warning. The
edge agent and the pool worker hand each policy they take to a :class:`StandingLog`, which
logs a finding as a warning and, once a later version puts it right, says so: a node
started from the policy pinned at its enrollment (older than the one that lists it) reads
in its log that it was unlisted in that version, then that the next one lists it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from policies.keys import public_key_text
from policies.model import Policy

log = logging.getLogger(__name__)

ADD = "sluicegate policy add-node <policy.toml>"
SIGN = "--sign <officer key>"


@dataclass(frozen=True)
class Standing:
    """Something the policy says of this node that the operator should fix."""

    text: str
    fix: str


def standing(
    policy: Policy, role: str, node: str, zone: str | None, key: bytes | None
) -> Standing | None:
    """What is wrong with the node's entry in ``policy`` (``role`` "edge" or "pool"; its
    configured ``zone``; its own public ``key``, when known), or None."""
    if role == "edge":
        edge = policy.edge(node)
        listed = (edge.zone, edge.key) if edge is not None else None
        what, effect = f"edge {node}", "the broker places none of its jobs: all run here"
        add = add_node_line("edge", node, zone or "<zone>", _key(key))
    elif role == "pool":
        worker = policy.worker(node)
        listed = (worker.zone, worker.key) if worker is not None else None
        what, effect = f"worker {node}", "the broker places nothing on it"
        add = add_node_line("pool", node, "", _key(key))
    else:
        return None
    version = f"policy v{policy.version}"
    if listed is None:
        return Standing(
            f"{version} does not list {what}: {effect}",
            f"have the officers list it ({add}; 'sluicegate enroll list' prints the line), "
            "then publish the new version",
        )
    listed_zone, listed_key = listed
    if zone is not None and listed_zone != zone:
        return Standing(
            f"{version} puts {what} in zone {listed_zone!r}, its configuration says {zone!r}: "
            "placements follow the policy's zone",
            f"set its zone to {listed_zone!r}, or have the officers move it in the policy",
        )
    if key is not None and listed_key != key:
        return Standing(
            f"{version} lists {what} with key {public_key_text(listed_key)}, not its own "
            f"{public_key_text(key)}: what it signs is refused",
            "have the officers put its key in its entry (edit the key, raise the version, "
            "sign), or restore the key the policy lists",
        )
    return None


def add_node_line(role: str, node: str, zone: str, key: str) -> str:
    """The ``policy add-node`` command that lists ``node`` (an enrolled ``role``: edge,
    pool, broker or app) with its zone and key text, for the officers to run."""
    if role == "edge":
        return f"{ADD} --edge {node} --zone {zone} --key {key} {SIGN}"
    if role == "pool":
        return f"{ADD} --worker {node} --pool <pool> --key {key} {SIGN}"
    if role == "broker":
        return f"{ADD} --broker {node} --key {key} {SIGN}"
    return f"{ADD} --app {node} --app-edge <edge it submits to> --results <topic prefix> {SIGN}"


def _key(key: bytes | None) -> str:
    return public_key_text(key) if key is not None else "<its key>"


class StandingLog:
    """Logs what each policy a node takes says of it: a finding as a warning, and the
    version that puts it right."""

    def __init__(self, node: str) -> None:
        self._node = node  # "edge line-1-pc", "worker north-gpu-1"
        self._wrong = False

    def heard(self, policy: Policy, found: Standing | None) -> None:
        if found is not None:
            self._wrong = True
            log.warning("%s; %s", found.text, found.fix)
        elif self._wrong:
            self._wrong = False
            log.info("policy v%d lists %s as configured", policy.version, self._node)
