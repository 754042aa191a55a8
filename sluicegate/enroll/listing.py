"""What ``sluicegate enroll list`` says of one registry entry: the node, its role, zone and
key, whether the signed policy already lists it (and with the key it enrolled with), and,
when it does not, the ``policy add-node`` line the officers run to list it.

Each role is listed where the policy keeps it: an edge, a pool worker and a broker by key
(``[edges]``, ``[pools.*.workers]``, ``[broker_signers]``), an app by name (``[apps]``,
which holds no key: its certificate proves it, the ACL limits it), an observer nowhere (the
ACL grants it what it reads). An entry of a role this release does not know is still
printed, with what is known of it. Pure: the CLI prints what this returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from policies.keys import public_key_text
from policies.model import Policy
from sluicegate import topics
from sluicegate.policy_standing import add_node_line


@dataclass(frozen=True)
class Listing:
    node: str
    role: str
    zone: str
    key: str
    status: str | None  # None without a policy to check against
    add: str | None  # the line that lists it, when it is not

    @classmethod
    def of(cls, entry: Mapping[str, object], policy: Policy | None) -> Listing:
        node, role, zone, key = (str(entry.get(k) or "") for k in ("node", "role", "zone", "key"))
        status: str | None = None
        add: str | None = None
        if policy is not None:
            status, missing = _status(policy, node, role, key)
            add = "  " + add_node_line(role, node, zone, key) if missing else None
        return cls(node, role or "unknown role", zone, key, status, add)

    def lines(self) -> list[str]:
        where = f" zone {self.zone}" if self.zone else ""
        key = f" key {self.key}" if self.key else ""
        status = f" ({self.status})" if self.status else ""
        out = [f"{self.role} {self.node}{where}{key}{status}"]
        if self.add:
            out.append(self.add)
        return out


def _status(policy: Policy, node: str, role: str, key: str) -> tuple[str, bool]:
    """What the policy says of the node, in words, and whether it still needs listing."""
    if role == "observer":
        return (
            "observer: not a policy entry; 'sluicegate policy acl <policy.toml> --observer "
            f"{node}' lets it read",
            False,
        )
    if role == "bridge":
        peer = node.removeprefix(topics.PEER_BRIDGE_PREFIX)
        if peer in policy.peers:
            return f"the bridge of sister campus {peer!r}, which [peers] lists", False
        return f"the bridge of {peer!r}, which [peers] does not list: it may do nothing", False
    if role == "app":
        listed = any(app.app_id == node for app in policy.apps)
        return ("in policy", False) if listed else ("NOT in policy", True)
    held = policy.node_key(node)
    if held is None:
        return "NOT in policy", role in ("edge", "pool", "broker")
    if key and public_key_text(held) != key:
        return (
            f"in policy with another key, {public_key_text(held)}: it gets nothing until "
            "the officers put the key it enrolled with in its entry, raise the version and "
            "sign",
            False,
        )
    return "in policy", False
