"""The broker's decisions on usage records: whether a record may be taken from the node whose
topic carried it, what a seq already held makes of it (a duplicate, or a conflict), whether
it links to its neighbours in the node's chain, how many of a node's records are missing,
and what it counts for, per line and pool.

A record is taken only when its ``node`` is the topic's sender (which the ACL lets only
that node write), the policy lists that node with a key, the record's ``kind`` is that
node's role, and the node's signature verifies with the listed key. Within one message, a
record that the next one taken names as its ``prev`` (the next seq) is vouched for by that
record's signature: the digest it names covers the record and its signature, so a record
altered on the way would break the link. A message's records are therefore screened last
to first (:class:`Screening`), and a run of linked records costs one signature check, at
its end, not one a record (an Ed25519 verify is most of what screening costs). The store keeps the
first record of each (node, seq); the same record again is a duplicate (acknowledged, so
the node stops resending), a different one is a conflict: kept aside, counted, never
overwriting. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from policies.model import Policy
from sluicegate.metering.record import GENESIS, SignedUsage

Outcome = Literal["new", "duplicate", "conflict"]
EDGE_POOL = "edge"  # the pool label of a job an edge ran itself


@dataclass(frozen=True, slots=True)
class UsageRefusal:
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class Screened:
    """One record as screened: its digest (``SignedUsage.digest``) and, if it may not be
    taken, why not."""

    digest: bytes
    refusal: UsageRefusal | None


class Screening:
    """The records of one message from ``sender``, fed last to first (:meth:`take`)."""

    def __init__(self, sender: str, policy: Policy | None) -> None:
        self.sender = sender
        self.policy = policy
        self._vouched: tuple[int, str] | None = None  # (seq, prev) of the last one taken

    def take(self, signed: SignedUsage) -> Screened:
        """Screen the record that comes before every one taken so far in the message."""
        canonical = signed.record.canonical()
        digest = signed.digest(canonical)
        record = signed.record
        vouched = self._vouched is not None and self._vouched == (record.seq + 1, digest.hex())
        refusal = screen(signed, self.sender, self.policy, canonical=canonical, vouched=vouched)
        self._vouched = (record.seq, record.prev) if refusal is None else None
        return Screened(digest, refusal)


def screen(
    signed: SignedUsage,
    sender: str,
    policy: Policy | None,
    *,
    canonical: bytes | None = None,
    vouched: bool = False,
) -> UsageRefusal | None:
    """None when the broker may take ``signed`` from ``sender``; else why not. ``vouched``:
    a record taken already names it as its ``prev``, so its signature is not checked again."""
    record = signed.record
    if record.node != sender:
        return UsageRefusal(
            "usage.id_mismatch",
            f"a usage record sent by {sender!r} names node {record.node!r}; a node ships "
            "only its own records",
        )
    if policy is None:
        return UsageRefusal("usage.no_policy", "the broker holds no verified policy yet")
    role = _role(policy, sender)
    key = policy.node_key(sender)
    if role is None or key is None:
        return UsageRefusal(
            "usage.not_in_policy",
            f"node {sender!r} is not listed as an edge or worker in policy "
            f"{policy.campus!r} v{policy.version}; its records are kept by it until it is",
        )
    if record.kind != role:
        return UsageRefusal(
            "usage.kind_mismatch",
            f"record {record.seq} of {sender!r} says kind {record.kind!r}; the policy lists "
            f"{sender!r} as a {'worker' if role == 'pool' else 'edge'}",
        )
    if not vouched and not signed.node_signature_valid(key, canonical):
        return UsageRefusal(
            "usage.bad_signature",
            f"record {record.seq} of {sender!r} is not signed by the key policy "
            f"v{policy.version} lists for it (altered, or signed with another key)",
        )
    return None


def _role(policy: Policy, node: str) -> Literal["pool", "edge"] | None:
    if policy.worker(node) is not None:
        return "pool"
    if policy.edge(node) is not None:
        return "edge"
    return None


def outcome(digest_hex: str, held_digest_hex: str | None) -> Outcome:
    """What a record of digest ``digest_hex`` is, given the digest already held for its
    (node, seq) (None: nothing was, and it is stored now)."""
    if held_digest_hex is None:
        return "new"
    return "duplicate" if held_digest_hex == digest_hex else "conflict"


def link_breaks(
    signed: SignedUsage, before_digest_hex: str | None, after_prev_hex: str | None
) -> int:
    """How many of a new record's links to its held neighbours are broken (0, 1 or 2): its
    ``prev`` against the digest of the node's record ``seq - 1`` (the genesis digest for
    seq 1), and the ``prev`` of record ``seq + 1`` against its own digest. A neighbour not
    held yet is no break."""
    breaks = 0
    record = signed.record
    expected = GENESIS.hex() if record.seq == 1 else before_digest_hex
    if expected is not None and record.prev != expected:
        breaks += 1
    if after_prev_hex is not None and after_prev_hex != signed.digest().hex():
        breaks += 1
    return breaks


def missing(last_seq: int, held: int) -> int:
    """Records a node numbered up to ``last_seq`` that the broker does not hold (gaps)."""
    return max(0, last_seq - held)


@dataclass(frozen=True, slots=True)
class Counted:
    """What a new record adds to the per-line, per-pool counters."""

    line: str
    pool: str
    device_s: float
    ran: bool  # an attempt that ran (event 'ran')
    billed: bool  # an edge's settlement: the job is billed to its line


def counted(signed: SignedUsage, policy: Policy | None) -> Counted:
    record = signed.record
    if record.event == "settled":
        worker = policy.worker(record.settled_node) if policy is not None else None
        pool = worker.pool if worker is not None else EDGE_POOL
        return Counted(record.line, pool, 0.0, ran=False, billed=True)
    worker = policy.worker(record.node) if policy is not None else None
    pool = worker.pool if worker is not None else EDGE_POOL
    return Counted(record.line, pool, record.device_us / 1e6, ran=True, billed=False)
