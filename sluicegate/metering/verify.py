"""Checking a usage export offline, against the keys of a policy: every record's node
signature and broker receipt, each node's numbering and hash chain, and the broker-signed
manifest (its signature, the sha256 of the record lines, each node's head).

What is wrong is named record by record (the export's line number, node and seq) as one of
a few kinds a person can act on: ``altered`` (a signature that fails), ``removed`` (a gap,
a broken chain link, a node's first or last records missing against its head),
``inserted`` (a record the manifest does not account for, or another record in a seq's
place), ``repeated`` (the same record twice), ``reordered``, ``unknown-key`` (a node or
broker the policy does not list, or a node in another role), ``manifest`` and
``unreadable``. The check never raises for bad input: whatever the bytes, the answer is a
:class:`Verification`. Pure: no files, no clock, no network.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import ValidationError

from policies.model import Policy
from sluicegate.metering.record import (
    GENESIS,
    Manifest,
    ManifestLine,
    NodeHead,
    SignedUsage,
    from_line,
)

Kind = Literal[
    "altered",
    "removed",
    "inserted",
    "repeated",
    "reordered",
    "unknown-key",
    "manifest",
    "unreadable",
]
KINDS: tuple[Kind, ...] = (
    "altered",
    "removed",
    "inserted",
    "repeated",
    "reordered",
    "unknown-key",
    "manifest",
    "unreadable",
)


@dataclass(frozen=True, slots=True)
class Problem:
    kind: Kind
    message: str
    line: int | None = None  # 1-based line of the export
    node: str | None = None
    seq: int | None = None

    def __str__(self) -> str:
        where = f"line {self.line}" if self.line is not None else "export"
        if self.node is not None:
            where += f" ({self.node}" + (f" #{self.seq}" if self.seq is not None else "") + ")"
        return f"{where}: {self.kind}: {self.message}"


@dataclass(frozen=True, slots=True)
class Located:
    """A record as read, with the line it was on."""

    line: int
    signed: SignedUsage


@dataclass(frozen=True)
class Verification:
    """What the export holds and what is wrong with it; ``ok`` when nothing is."""

    problems: tuple[Problem, ...]
    records: tuple[Located, ...]  # every readable record, first copy of each (node, seq)
    manifest: Manifest | None
    lines: int
    nodes: int
    counts: dict[str, int] = field(default_factory=dict)  # problems by kind

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def totals(self) -> dict[str, int]:
        """Lines read, distinct records, nodes, and the problems of each kind found."""
        return {"lines": self.lines, "records": len(self.records), "nodes": self.nodes} | {
            f"problems.{kind}": n for kind, n in self.counts.items()
        }

    def summary(self) -> str:
        if self.ok and self.manifest is not None:
            m = self.manifest
            return (
                f"OK {len(self.records)} records from {self.nodes} nodes, exported by "
                f"{m.broker!r}, every signature, chain and head checked"
            )
        kinds = ", ".join(f"{n} {k}" for k, n in self.counts.items())
        return f"NOT VERIFIED: {len(self.problems)} problems ({kinds}) in {self.lines} lines"


def export_lines_of(data: bytes, problems: list[Problem]) -> list[bytes]:
    """An export's lines, without the newline that ends it (a missing one is a problem)."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        problems.append(
            Problem("unreadable", "the export does not end with a newline (cut short?)", len(lines))
        )
    return lines


def verify_export(data: bytes, policy: Policy) -> Verification:
    """Check ``data``, an export as written (records, then the manifest line), against the
    node and broker keys ``policy`` lists."""
    problems: list[Problem] = []
    lines = export_lines_of(data, problems)
    manifest, record_lines = read_manifest(lines, policy, problems)
    altered: set[int] = set()
    records = _records(record_lines, policy, manifest, problems, altered)
    if manifest is not None:
        _heads(records, manifest, problems, altered)
    problems.sort(key=lambda p: (p.line is None, p.line or 0))  # stable: by line, then found
    counts = Counter(p.kind for p in problems)
    return Verification(
        problems=tuple(problems),
        records=tuple(records),
        manifest=manifest,
        lines=len(lines),
        nodes=len({r.signed.record.node for r in records}),
        counts={k: counts[k] for k in KINDS if counts[k]},
    )


def read_manifest(
    lines: list[bytes], policy: Policy, problems: list[Problem]
) -> tuple[Manifest | None, list[bytes]]:
    """The manifest (checked) and the record lines before it."""
    if not lines or not lines[-1].startswith(b'{"manifest"'):
        problems.append(Problem("manifest", "no manifest: the export's last line is missing"))
        return None, lines
    n = len(lines)
    record_lines = lines[:-1]
    try:
        manifest = ManifestLine.model_validate_json(lines[-1]).manifest
    except ValidationError as exc:
        problems.append(Problem("manifest", f"the manifest cannot be read: {_first(exc)}", n))
        return None, record_lines
    key = policy.broker_key(manifest.broker)
    if key is None:
        brokers = _names(b.key_id for b in policy.brokers)
        problems.append(
            Problem(
                "manifest",
                f"signed by broker {manifest.broker!r}, which policy {policy.campus!r} "
                f"v{policy.version} does not list (brokers: {brokers})",
                n,
            )
        )
    elif not manifest.signature_valid(key):
        problems.append(
            Problem("manifest", f"its signature is not broker {manifest.broker!r}'s (altered)", n)
        )
    digest = hashlib.sha256(b"".join(line + b"\n" for line in record_lines)).hexdigest()
    if digest != manifest.records_sha256:
        problems.append(
            Problem(
                "manifest",
                f"the record lines' sha256 is {digest[:16]}…, the manifest says "
                f"{manifest.records_sha256[:16]}… (lines added, removed, changed or moved)",
                n,
            )
        )
    for head in manifest.heads:
        if head.first_seq > head.last_seq:
            problems.append(
                Problem("manifest", f"head {head.first_seq}..{head.last_seq}", n, head.node)
            )
    return manifest, record_lines


def _records(
    lines: list[bytes],
    policy: Policy,
    manifest: Manifest | None,
    problems: list[Problem],
    altered: set[int],
) -> list[Located]:
    """Each line read and checked on its own, and against the lines before it; the lines
    of records not as signed go into ``altered``."""
    out: list[Located] = []
    held: dict[tuple[str, int], Located] = {}
    last: tuple[str, int] | None = None
    for n, raw in enumerate(lines, start=1):
        try:
            signed = from_line(raw)
        except ValidationError as exc:
            what = "a second manifest" if raw.startswith(b'{"manifest"') else "not a record"
            problems.append(Problem("unreadable", f"{what}: {_first(exc)}", n))
            continue
        r = signed.record
        here = (r.node, r.seq)
        if signature_problems(n, signed, policy, problems):
            altered.add(n)
        if manifest is not None and not manifest.from_ms <= r.at_ms <= manifest.to_ms:
            problems.append(
                Problem(
                    "inserted",
                    f"written at {r.at_ms} ms, outside the export's period "
                    f"[{manifest.from_ms}, {manifest.to_ms}]",
                    n,
                    r.node,
                    r.seq,
                )
            )
        earlier = held.get(here)
        if earlier is not None:
            same = earlier.signed.digest() == signed.digest()
            problems.append(
                Problem(
                    "repeated" if same else "inserted",
                    f"seq {r.seq} again (first on line {earlier.line})"
                    + ("" if same else ": another record in its place"),
                    n,
                    r.node,
                    r.seq,
                )
            )
            continue
        if last is not None and here < last:
            problems.append(
                Problem(
                    "reordered",
                    f"after {last[0]} #{last[1]}: records go by node, then seq",
                    n,
                    r.node,
                    r.seq,
                )
            )
        last = here if last is None or here > last else last
        located = Located(n, signed)
        held[here] = located
        out.append(located)
    return out


def signature_problems(
    n: int, signed: SignedUsage, policy: Policy, problems: list[Problem]
) -> bool:
    """The node's signature and the broker's receipt, at most one problem of each kind;
    True when the record is not as its node and broker signed it."""
    r = signed.record

    def problem(kind: Kind, message: str) -> None:
        problems.append(Problem(kind, message, n, r.node, r.seq))

    worker, edge = policy.worker(r.node), policy.edge(r.node)
    role = "pool" if worker is not None else "edge" if edge is not None else None
    key = worker.key if worker is not None else edge.key if edge is not None else None
    node_ok = True
    if key is None:
        problem(
            "unknown-key",
            f"node {r.node!r} is not an edge or worker of policy {policy.campus!r} "
            f"v{policy.version}",
        )
    elif r.kind != role:
        problem(
            "unknown-key",
            f"the record says kind {r.kind!r}; the policy lists {r.node!r} as "
            f"{'a worker' if role == 'pool' else 'an edge'}",
        )
    else:
        node_ok = signed.node_signature_valid(key)
    receipt = signed.receipt
    broker_key = policy.broker_key(receipt.broker) if receipt is not None else None
    if receipt is not None and broker_key is None:
        problem(
            "unknown-key", f"receipt by broker {receipt.broker!r}, which the policy does not list"
        )
    receipt_ok = broker_key is None or signed.receipt_valid(broker_key)
    if not node_ok and not receipt_ok:
        problem("altered", f"neither the signature of {r.node!r} nor the receipt fits it")
    elif not node_ok:
        problem("altered", f"not signed by the key of {r.node!r} (its receipt fits)")
    elif not receipt_ok:
        assert receipt is not None
        problem("altered", f"the receipt is not broker {receipt.broker!r}'s for this record")
    elif receipt is None:
        problem("altered", "no broker receipt")
    return not (node_ok and receipt_ok and receipt is not None)


def _heads(
    records: list[Located], manifest: Manifest, problems: list[Problem], altered: set[int]
) -> None:
    """Each node's run of records against its chain and the manifest's head (a link from
    an altered record is not reported again: its problem is named already)."""
    by_node: dict[str, list[Located]] = {}
    for located in records:
        by_node.setdefault(located.signed.record.node, []).append(located)
    heads = {h.node: h for h in manifest.heads}
    for node, run in by_node.items():
        run.sort(key=lambda x: x.signed.record.seq)
        head = heads.get(node)
        if head is None:
            first = run[0]
            problems.append(
                Problem(
                    "inserted",
                    f"the manifest has no head for {node!r}: {len(run)} records it does not "
                    "account for",
                    first.line,
                    node,
                    first.signed.record.seq,
                )
            )
        _chain(node, run, head, problems, altered)
    for node, head in heads.items():
        if node not in by_node:
            problems.append(
                Problem(
                    "removed",
                    f"all its records, seq {head.first_seq} to {head.last_seq}, are missing",
                    None,
                    node,
                )
            )


def _chain(
    node: str,
    run: list[Located],
    head: NodeHead | None,
    problems: list[Problem],
    altered: set[int],
) -> None:
    first, final = run[0], run[-1]
    first_seq = first.signed.record.seq
    if head is not None and first_seq != head.first_seq:
        if first_seq > head.first_seq:
            problems.append(
                _gap(head.first_seq, first_seq - 1, first, node, "before the first here")
            )
        else:
            problems.append(
                Problem(
                    "inserted",
                    f"the manifest's head starts at seq {head.first_seq}",
                    first.line,
                    node,
                    first_seq,
                )
            )
    if first_seq == 1 and first.signed.record.prev != GENESIS.hex():
        problems.append(
            Problem("removed", "seq 1 does not start a chain (prev)", first.line, node, 1)
        )
    for before, after in itertools.pairwise(run):
        b, a = before.signed.record, after.signed.record
        if a.seq != b.seq + 1:
            problems.append(_gap(b.seq + 1, a.seq - 1, after, node, f"after line {before.line}"))
        elif a.prev != before.signed.digest().hex() and before.line not in altered:
            problems.append(
                Problem(
                    "removed",
                    f"its prev does not name seq {b.seq} on line {before.line}: the record "
                    "it chains to is not that one",
                    after.line,
                    node,
                    a.seq,
                )
            )
    if head is None:
        return
    last_seq = final.signed.record.seq
    if last_seq < head.last_seq:
        problems.append(
            Problem(
                "removed",
                f"the manifest's head ends at seq {head.last_seq}: "
                f"{_seqs(last_seq + 1, head.last_seq)} (the node's last) missing",
                final.line,
                node,
                last_seq,
            )
        )
    elif last_seq > head.last_seq:
        problems.append(
            Problem(
                "inserted",
                f"the manifest's head ends at seq {head.last_seq}",
                final.line,
                node,
                last_seq,
            )
        )
    elif final.signed.digest().hex() != head.last_digest and final.line not in altered:
        problems.append(
            Problem(
                "altered",
                "the manifest's head names another record for this seq",
                final.line,
                node,
                last_seq,
            )
        )


def _gap(low: int, high: int, at: Located, node: str, where: str) -> Problem:
    return Problem(
        "removed", f"{_seqs(low, high)} missing ({where})", at.line, node, at.signed.record.seq
    )


def _seqs(low: int, high: int) -> str:
    return f"seq {low}" if low == high else f"seq {low} to {high}"


def _first(exc: ValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return str(exc)
    e = errors[0]
    where = ".".join(str(p) for p in e["loc"])
    return f"{where}: {e['msg']}" if where else e["msg"]


def _names(names: Iterable[str]) -> str:
    return ", ".join(sorted(names)) or "none"
