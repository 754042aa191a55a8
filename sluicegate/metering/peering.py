"""Billing between two sister campuses: which usage records each sends the other, the
settlement export that holds both sides' records, its offline check, and what each campus
owes the other, job for job. Pure: no clock, no network, no files.

A job of campus O run on campus R's pool leaves two records that matter: R's worker's
``ran`` record (its ``campus`` names O) and O's edge's ``settled`` record (its
``settled_node`` names the worker as ``<worker>@R``). Each broker countersigns its own
campus's record and sends it to the other (``topics.peer_usage``), so both campuses hold
both. A settlement export (``GET /v1/usage/export?peer=<campus>``) holds this campus's
records that concern the peer, then the peer's records that concern this campus, then a
manifest this campus's broker signed naming the peer. Checked offline against this
campus's policy (:func:`verify_peer_export`): a record of ours by its node's key and our
broker's receipt, as in a campus's own export; a record of theirs by the receipt of a
broker our ``[peers]`` entry pins (our policy does not list the peer's nodes), and it must
concern us. Neither side's chains are whole in it (a node's other records are its own
campus's business), so no head or gap is checked.

Settled (:func:`settle_peer`) the same way on both sides, each job is billed once: the
attempt its owning edge settled, at its device time and the agreement's prices (what O
sends R under ``send`` is what R receives under ``receive``: the same terms, both signed).
So the campus that ran the jobs and the campus that owns them list the same jobs and the
same device-seconds: what one is owed is what the other owes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

from policies.keys import SigningKey
from policies.model import Policy
from policies.peers import Terms
from sluicegate.metering.record import SignedUsage, Usage, export_lines
from sluicegate.metering.verify import (
    KINDS,
    Located,
    Problem,
    Verification,
    export_lines_of,
    read_manifest,
    signature_problems,
)

Direction = Literal["owed_by_us", "owed_to_us"]
DIRECTIONS: tuple[Direction, ...] = ("owed_by_us", "owed_to_us")


def _campus_of(worker: str) -> str:
    return worker.partition("@")[2]


def concerns(record: Usage, peer: str) -> bool:
    """Whether a record of this campus is one its peer ``peer`` keeps: a run of the peer's
    job here, or a settlement here of a job the peer's pool ran."""
    if record.event == "ran":
        return record.campus == peer
    return _campus_of(record.settled_node) == peer


def theirs_problem(policy: Policy, peer: str, signed: SignedUsage) -> str | None:
    """Why a record ``peer`` sent is not one this campus keeps, or None: countersigned by a
    broker our ``[peers.<peer>]`` entry pins, and concerning us."""
    entry = policy.peers.get(peer)
    if entry is None:
        return f"campus {peer!r} is no sister campus of policy v{policy.version}"
    receipt = signed.receipt
    if receipt is None:
        return "no receipt: a peer's record is kept only as its broker countersigned it"
    if not any(signed.receipt_valid(k) for k in entry.brokers.values()):
        return f"the receipt is not by a broker of {peer!r} that policy v{policy.version} pins"
    if not concerns(signed.record, policy.campus):
        r = signed.record
        return f"{r.event} record {r.seq} of {r.node} is no job between {peer!r} and us"
    return None


def peer_export(
    ours: list[SignedUsage],
    theirs: list[SignedUsage],
    key: SigningKey,
    *,
    broker: str,
    peer: str,
    exported_ms: int,
    from_ms: int,
    to_ms: int,
) -> bytes:
    """A settlement export: our records (by node, seq), theirs (by node, seq), the manifest
    signed with ``key`` (this replica's) naming ``peer``."""

    def order(records: list[SignedUsage]) -> list[SignedUsage]:
        return sorted(records, key=lambda s: (s.record.node, s.record.seq))

    lines = export_lines(
        order(ours) + order(theirs),
        key,
        broker=broker,
        exported_ms=exported_ms,
        from_ms=from_ms,
        to_ms=to_ms,
        peer=peer,
    )
    return b"\n".join(lines) + b"\n"


@dataclass(frozen=True)
class PeerVerification:
    """A settlement export as checked: ``verification`` as for any export, and which of
    its records are ours and which the peer's."""

    verification: Verification
    ours: tuple[Located, ...]
    theirs: tuple[Located, ...]

    @property
    def ok(self) -> bool:
        return self.verification.ok


def verify_peer_export(data: bytes, policy: Policy, peer: str) -> PeerVerification:
    """Check a settlement export with ``peer`` against ``policy``; never raises."""
    problems: list[Problem] = []
    lines = export_lines_of(data, problems)
    manifest, record_lines = read_manifest(lines, policy, problems)
    if manifest is not None and manifest.peer != peer:
        said = f"with {manifest.peer!r}" if manifest.peer else "of a campus's own records"
        problems.append(Problem("manifest", f"an export {said}, not with {peer!r}", len(lines)))
    ours: list[Located] = []
    theirs: list[Located] = []
    seen: set[bytes] = set()
    entry = policy.peers.get(peer)
    peer_keys = list(entry.brokers.values()) if entry is not None else []
    for n, raw in enumerate(record_lines, start=1):
        try:
            signed = SignedUsage.model_validate_json(raw)
        except ValueError:
            problems.append(Problem("unreadable", "not a record", n))
            continue
        r = signed.record
        digest = signed.digest()
        if digest in seen:
            problems.append(Problem("repeated", "the same record again", n, r.node, r.seq))
            continue
        seen.add(digest)
        if manifest is not None and not manifest.from_ms <= r.at_ms <= manifest.to_ms:
            problems.append(
                Problem("inserted", "written outside the export's period", n, r.node, r.seq)
            )
        if signed.receipt is not None and any(signed.receipt_valid(k) for k in peer_keys):
            why = theirs_problem(policy, peer, signed)
            if why is not None:
                problems.append(Problem("inserted", why, n, r.node, r.seq))
            theirs.append(Located(n, signed))
            continue
        if not signature_problems(n, signed, policy, problems) and not concerns(r, peer):
            problems.append(
                Problem("inserted", f"a record of ours about no job with {peer!r}", n, r.node)
            )
        ours.append(Located(n, signed))
    problems.sort(key=lambda p: (p.line is None, p.line or 0))
    counts = Counter(p.kind for p in problems)
    located = tuple(sorted(ours + theirs, key=lambda x: x.line))
    verification = Verification(
        problems=tuple(problems),
        records=located,
        manifest=manifest,
        lines=len(lines),
        nodes=len({("ours", x.signed.record.node) for x in ours})
        + len({x.signed.record.node for x in theirs}),
        counts={k: counts[k] for k in KINDS if counts[k]},
    )
    return PeerVerification(verification, tuple(ours), tuple(theirs))


@dataclass(frozen=True, slots=True)
class Billed:
    """One job between the two campuses, billed once: the attempt its edge settled."""

    direction: Direction
    line: str  # the owning campus's edge
    job_id: str
    worker: str  # on the campus that ran it
    attempt: int
    device_us: int
    owner: str


@dataclass(frozen=True)
class PeerSettlement:
    """What one campus owes its peer and is owed by it, job by job, with the prices."""

    campus: str
    peer: str
    billed: tuple[Billed, ...]
    unsettled: int  # runs whose job no settlement names (yet)
    waste: int  # runs of settled jobs that were not the attempt settled
    currency: str
    prices: dict[Direction, tuple[Decimal, Decimal]]  # (per device-second, per job)

    def jobs(self, direction: Direction) -> list[Billed]:
        return [b for b in self.billed if b.direction == direction]

    def totals(self, direction: Direction) -> tuple[int, Decimal, Decimal]:
        """Jobs, device-seconds and the amount, one way."""
        jobs = self.jobs(direction)
        device_s = Decimal(sum(b.device_us for b in jobs)) / Decimal(1_000_000)
        per_s, per_job = self.prices[direction]
        return len(jobs), device_s, device_s * per_s + per_job * len(jobs)


def settle_peer(checked: PeerVerification, policy: Policy, peer: str) -> PeerSettlement:
    """Each job between us and ``peer`` billed once, each way (the export checked first)."""
    us = policy.campus
    records = [x.signed.record for x in (*checked.ours, *checked.theirs)]
    runs: dict[tuple[str, str, str, str, int], Usage] = {}
    for r in records:
        if r.event == "ran" and r.campus in (us, peer):
            ran_on = peer if r.campus == us else us
            runs[(ran_on, r.node, r.line, r.job_id, r.attempt)] = r
    billed: list[Billed] = []
    used: set[tuple[str, str, str, str, int]] = set()
    for r in records:
        if r.event != "settled" or not r.settled_node:
            continue
        worker, _, ran_on = r.settled_node.partition("@")
        if ran_on not in (us, peer):
            continue
        key = (ran_on, worker, r.line, r.job_id, r.settled_attempt)
        run = runs.get(key)
        if run is None or key in used:
            continue
        used.add(key)
        direction: Direction = "owed_to_us" if ran_on == us else "owed_by_us"
        billed.append(
            Billed(direction, r.line, r.job_id, worker, r.settled_attempt, run.device_us, r.owner)
        )
    settled_jobs = {(k[0], k[2], k[3]) for k in used}
    unsettled = sum(1 for k in runs if (k[0], k[2], k[3]) not in settled_jobs)
    waste = sum(1 for k in runs if (k[0], k[2], k[3]) in settled_jobs and k not in used)
    entry = policy.peers.get(peer)
    send = entry.send if entry is not None else None
    receive = entry.receive if entry is not None else None
    prices: dict[Direction, tuple[Decimal, Decimal]] = {
        "owed_by_us": _prices(send),
        "owed_to_us": _prices(receive),
    }
    currency = (send.currency if send is not None else "") or (
        receive.currency if receive is not None else ""
    )
    billed.sort(key=lambda b: (b.direction, b.line, b.job_id))
    return PeerSettlement(us, peer, tuple(billed), unsettled, waste, currency, prices)


def _prices(terms: Terms | None) -> tuple[Decimal, Decimal]:
    if terms is None:
        return Decimal(0), Decimal(0)
    return Decimal(str(terms.device_second)), Decimal(str(terms.job))
