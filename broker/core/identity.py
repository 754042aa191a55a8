"""Who is speaking, for every message the broker acts on: the policy's answer, never the
message's.

The sender's id comes from the topic (``sluicegate.topics.sender`` / ``node_of``), which the
ACL lets only that authenticated node write. These pure functions check it against the
signed policy: an edge's origin zone is its policy entry's zone (a request only names the
edge, and a name that is not the topic's is refused); a worker whose id or zone is not the
policy's gets no placement. Each refusal has a stable code and a sentence saying what
would make it pass. No I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.model import Policy


@dataclass(frozen=True, slots=True)
class IdentityRefusal:
    code: str
    reason: str


def _version(policy: Policy) -> str:
    return f"policy {policy.campus!r} v{policy.version}"


def edge_origin(policy: Policy, sender: str, claimed: str) -> str | IdentityRefusal:
    """The origin zone of a request that came on edge ``sender``'s topic naming ``claimed``
    as its edge; a :class:`IdentityRefusal` if the two differ or the policy does not list it."""
    if claimed != sender:
        return IdentityRefusal(
            "edge.id_mismatch",
            f"the request names edge {claimed!r} but was sent by {sender!r} (its topic and "
            "certificate); an edge asks only for itself",
        )
    entry = policy.edge(sender)
    if entry is None:
        return IdentityRefusal(
            "edge.not_in_policy",
            f"edge {sender!r} is not listed in {_version(policy)}, so it gets no "
            "placements; a compliance officer adds it ('sluicegate policy add-node') and "
            "signs the new version",
        )
    return entry.zone


def worker_standing(policy: Policy, sender: str, claimed: str, zone: str) -> IdentityRefusal | None:
    """None if worker ``sender`` may be placed on, as it describes itself (``claimed`` id,
    ``zone``); else why not."""
    if claimed != sender:
        return IdentityRefusal(
            "worker.id_mismatch",
            f"a message on worker {sender!r}'s topic describes worker {claimed!r}",
        )
    entry = policy.worker(sender)
    if entry is None:
        return IdentityRefusal(
            "worker.not_in_policy",
            f"worker {sender!r} is not listed in any pool of {_version(policy)}, so nothing "
            "is placed on it; a compliance officer adds it ('sluicegate policy add-node')",
        )
    if zone != entry.zone:
        return IdentityRefusal(
            "worker.zone_mismatch",
            f"worker {sender!r} says it is in zone {zone!r}; {_version(policy)} puts it in "
            f"{entry.zone!r} (pool {entry.pool!r}): fix its [pool] zone",
        )
    return None


def same_sender(kind: str, sender: str, claimed: str | None) -> IdentityRefusal | None:
    """A release or completion names the node whose topic carried it, or is refused."""
    if claimed is not None and claimed != sender:
        return IdentityRefusal(
            f"{kind}.id_mismatch",
            f"a {kind} sent by {sender!r} names {claimed!r}; a node reports only its own",
        )
    return None
