"""A settled period written out for people and programs: a table to read, CSV (the totals,
or the invoices when there are prices) and JSON (everything: totals, waste, unsettled jobs,
notes, invoices). Money and device-seconds are written as decimal strings, never floats.
Pure: text in memory.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from decimal import Decimal
from typing import Any

from sluicegate.metering.peering import DIRECTIONS, PeerSettlement
from sluicegate.metering.prices import Invoice
from sluicegate.metering.report import Attempt, By, Settlement, Totals, overall, totals

LISTED = 20  # waste attempts and unsettled jobs a table names before it counts the rest
_TOTAL_FIELDS = (
    "device_s",
    "jobs",
    "waste_device_s",
    "waste_attempts",
    "unsettled_jobs",
    "unsettled_device_s",
)


def iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    moment = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def period(s: Settlement) -> str:
    return f"{iso(s.from_ms) or 'the start'} to {iso(s.to_ms) or 'the end'}"


def _totals_doc(row: Totals) -> dict[str, Any]:
    return {
        f: str(v) if isinstance(v, Decimal) else v
        for f, v in ((f, getattr(row, f)) for f in _TOTAL_FIELDS)
    }


def _attempt_doc(a: Attempt) -> dict[str, Any]:
    return {
        "export_line": a.export_line,
        "node": a.node,
        "line": a.job[0],
        "job_id": a.job[1],
        "attempt": a.attempt,
        "at": iso(a.at_ms),
        "device_s": str(a.device_s),
        "pool": a.pool,
        "owner": a.owner,
        "status": a.status,
    }


def _invoice_doc(inv: Invoice) -> dict[str, Any]:
    return {
        "by": inv.by,
        "key": inv.key,
        "currency": inv.currency,
        "lines": [
            {
                "item": line.item,
                "pool": line.pool,
                "device_class": line.device_class,
                "quantity": str(line.quantity),
                "unit_price": str(line.unit_price),
                "amount": str(line.amount),
            }
            for line in inv.lines
        ],
        "total": str(inv.total),
    }


def as_json(s: Settlement, by: By, invoices: list[Invoice] | None, verified: bool) -> str:
    doc: dict[str, Any] = {
        "from": iso(s.from_ms),
        "to": iso(s.to_ms),
        "verified": verified,
        "by": by,
        "totals": [{by: row.key, **_totals_doc(row)} for row in totals(s, by)],
        "overall": _totals_doc(overall(s)),
        "undelivered_jobs": s.undelivered,
        "waste": [{**_attempt_doc(w.attempt), "reason": w.reason} for w in s.waste],
        "unsettled": [
            {
                "line": u.job[0],
                "job_id": u.job[1],
                "device_s": str(u.device_s),
                "attempts": [_attempt_doc(a) for a in u.attempts],
            }
            for u in s.unsettled
        ],
        "notes": list(s.notes),
    }
    if invoices is not None:
        doc["invoices"] = [_invoice_doc(inv) for inv in invoices]
    return json.dumps(doc, indent=2) + "\n"


def as_csv(s: Settlement, by: By, invoices: list[Invoice] | None) -> str:
    """The invoices' lines (each invoice ending with its total) when there are prices;
    else the totals by ``by``."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if invoices is not None:
        writer.writerow(
            [
                invoices[0].by if invoices else by,
                "item",
                "pool",
                "device_class",
                "quantity",
                "unit_price",
                "amount",
                "currency",
            ]
        )
        for inv in invoices:
            for line in inv.lines:
                writer.writerow(
                    [
                        inv.key,
                        line.item,
                        line.pool,
                        line.device_class,
                        line.quantity,
                        line.unit_price,
                        line.amount,
                        inv.currency,
                    ]
                )
            writer.writerow([inv.key, "total", "", "", "", "", inv.total, inv.currency])
        return out.getvalue()
    writer.writerow([by, *_TOTAL_FIELDS])
    for row in [*totals(s, by), overall(s)]:
        writer.writerow([row.key, *(getattr(row, f) for f in _TOTAL_FIELDS)])
    return out.getvalue()


def as_table(s: Settlement, by: By, invoices: list[Invoice] | None, verified: str) -> str:
    """What a person reads: ``verified`` says what was checked of the export."""
    lines = [f"usage from {period(s)}, by {by} ({verified})", ""]
    head = (by, "device-s", "jobs", "waste-s", "waste", "unsettled", "unsettled-s")
    rows = [*totals(s, by), overall(s)]
    cells = [head] + [
        (
            r.key,
            str(r.device_s),
            str(r.jobs),
            str(r.waste_device_s),
            str(r.waste_attempts),
            str(r.unsettled_jobs),
            str(r.unsettled_device_s),
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    for i, c in enumerate(cells):
        if i == len(cells) - 1:
            lines.append("  ".join("-" * w for w in widths))
        lines.append(
            c[0].ljust(widths[0])
            + "  "
            + "  ".join(v.rjust(w) for v, w in zip(c[1:], widths[1:], strict=True))
        )
    total = overall(s)
    lines += [
        "",
        f"waste: {_n(total.waste_attempts, 'attempt')}, {total.waste_device_s} device-s, "
        "not billed",
    ]
    for w in s.waste[:LISTED]:
        a = w.attempt
        lines.append(
            f"  line {a.export_line}: {a.node} attempt {a.attempt} of {a.job[1]} "
            f"({a.job[0]}), {a.device_s} s: {w.reason}"
        )
    lines += _more(len(s.waste))
    if s.undelivered:
        lines.append(
            f"  {_n(s.undelivered, 'job')} settled with nothing delivered: every run waste"
        )
    lines += [
        "",
        f"unsettled: {_n(len(s.unsettled), 'job')}, not billed until their edge settles them",
    ]
    for u in s.unsettled[:LISTED]:
        lines.append(
            f"  {u.job[1]} ({u.job[0]}): {_n(len(u.attempts), 'attempt')}, {u.device_s} s, last "
            f"on {u.attempts[-1].node}"
        )
    lines += _more(len(s.unsettled))
    if s.notes:
        lines += ["", "notes:", *(f"  {n}" for n in s.notes)]
    for inv in invoices or []:
        money = f" ({inv.currency})" if inv.currency else ""
        lines += ["", f"invoice: {inv.by} {inv.key}{money}"]
        for line in inv.lines:
            lines.append(
                f"  {line.item:<15} {line.pool:<20} {line.device_class or '-':<14} "
                f"{line.quantity:>14} x {line.unit_price:<10} = {line.amount:>12}"
            )
        lines.append(f"  {'total':<81} {inv.total:>12}")
    return "\n".join(lines) + "\n"


def _more(count: int) -> list[str]:
    return (
        [f"  ... and {count - LISTED} more (--format json lists them all)"]
        if count > LISTED
        else []
    )


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def peer_table(settlement: PeerSettlement) -> str:
    """What a campus owes its sister campus and is owed by it, as a table, job by job."""
    s = settlement
    out = [f"settlement of {s.campus} with {s.peer} (verified)", ""]
    words = {
        "owed_by_us": f"{s.campus} owes {s.peer}: its jobs {s.peer} ran",
        "owed_to_us": f"{s.peer} owes {s.campus}: {s.peer}'s jobs {s.campus} ran",
    }
    for direction in DIRECTIONS:
        jobs, device_s, amount = s.totals(direction)
        out.append(
            f"{words[direction]}: {jobs} jobs, {device_s:.6f} device-s, {amount:.6f} {s.currency}"
        )
        for b in s.jobs(direction):
            out.append(
                f"  {b.line} {b.job_id} attempt {b.attempt} on {b.worker}: "
                f"{Decimal(b.device_us) / Decimal(1_000_000):.6f} s"
            )
    out.append(f"unsettled runs: {s.unsettled}; waste runs: {s.waste} (neither billed)")
    return "\n".join(out) + "\n"


def peer_json(settlement: PeerSettlement) -> str:
    """The same as JSON: each direction's totals (decimal strings) and jobs."""
    s = settlement
    doc: dict[str, object] = {"campus": s.campus, "peer": s.peer, "currency": s.currency}
    for direction in DIRECTIONS:
        jobs, device_s, amount = s.totals(direction)
        doc[direction] = {
            "jobs": jobs,
            "device_s": f"{device_s:.6f}",
            "amount": f"{amount:.6f}",
            "items": [
                {
                    "line": b.line,
                    "job_id": b.job_id,
                    "worker": b.worker,
                    "attempt": b.attempt,
                    "device_us": b.device_us,
                    "owner": b.owner,
                }
                for b in s.jobs(direction)
            ],
        }
    doc["unsettled"], doc["waste"] = s.unsettled, s.waste
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"
