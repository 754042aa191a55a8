"""Settlement: which attempt of each job is billed, which are waste, which jobs are not
settled yet, and the totals of a period by line, owner, pool, model or device class.

The rules (``docs/metering.md``): a job is the pair (line, job id). Its edge settles it,
once: a ``ran`` record written by an edge (it ran the job itself) settles itself; a
``settled`` record written by the job's own edge names the worker and attempt it delivered
(or no one: nothing was delivered, the job expired or was dead-lettered). The attempt
settled is **billed**, in the period that holds the settlement; every other ``ran`` record
of the job is **waste** (a lost worker, a fenced return), counted in the period it ran in,
never billed. A job with ``ran`` records in the period and no settlement before its end is
**unsettled**, reported apart. A settlement whose attempt's record is not in the export
(it ran before the export's period) is listed, not billed. Pure: records in, figures out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

from policies.model import Policy
from sluicegate.metering.record import Usage
from sluicegate.metering.verify import Located

By = Literal["line", "owner", "pool", "model", "class", "data-class"]
BY: tuple[By, ...] = ("line", "owner", "pool", "model", "class", "data-class")
NONE = "(none)"  # a key a record leaves empty
ZERO_S = Decimal("0.000000")  # device-seconds: exact to the microsecond


@dataclass(frozen=True, slots=True)
class Attempt:
    """One ``ran`` record, as billing sees it."""

    export_line: int
    node: str
    job: tuple[str, str]  # (line, job id)
    attempt: int
    at_ms: int
    device_us: int
    owner: str
    model: str
    device_class: str
    data_class: str
    pool: str  # the policy's pool of the worker; "edge:<edge id>" for an edge's own run
    status: str

    @property
    def device_s(self) -> Decimal:
        return Decimal(self.device_us).scaleb(-6)

    def key(self, by: By) -> str:
        value = {
            "line": self.job[0],
            "owner": self.owner,
            "pool": self.pool,
            "model": self.model,
            "class": self.device_class,
            "data-class": self.data_class,
        }[by]
        return value or NONE


@dataclass(frozen=True, slots=True)
class Billed:
    attempt: Attempt
    settled_ms: int
    settled_line: int  # the export line of the settlement (the attempt's own, for an edge run)


@dataclass(frozen=True, slots=True)
class Waste:
    attempt: Attempt
    reason: str


@dataclass(frozen=True, slots=True)
class Unsettled:
    job: tuple[str, str]
    attempts: tuple[Attempt, ...]

    @property
    def device_s(self) -> Decimal:
        return sum((a.device_s for a in self.attempts), ZERO_S)


@dataclass(frozen=True, slots=True)
class Totals:
    key: str
    device_s: Decimal = ZERO_S
    jobs: int = 0
    waste_device_s: Decimal = ZERO_S
    waste_attempts: int = 0
    unsettled_jobs: int = 0
    unsettled_device_s: Decimal = ZERO_S


@dataclass(frozen=True)
class Settlement:
    from_ms: int | None
    to_ms: int | None
    billed: tuple[Billed, ...]
    waste: tuple[Waste, ...]
    unsettled: tuple[Unsettled, ...]
    undelivered: int  # jobs settled in the period with nothing delivered (all their runs waste)
    notes: tuple[str, ...]  # settlements not billed, and why


def pool_of(record: Usage, policy: Policy) -> str:
    if record.kind == "edge":
        return f"edge:{record.node}"
    worker = policy.worker(record.node)
    return worker.pool if worker is not None else f"unlisted:{record.node}"


def attempt_of(located: Located, policy: Policy, owner: str = "") -> Attempt:
    r = located.signed.record
    return Attempt(
        export_line=located.line,
        node=r.node,
        job=(r.line, r.job_id),
        attempt=r.attempt,
        at_ms=r.at_ms,
        device_us=r.device_us,
        owner=r.owner or owner,
        model=r.model,
        device_class=r.device_class,
        data_class=r.data_class,
        pool=pool_of(r, policy),
        status=r.status,
    )


@dataclass
class _Job:
    ran: list[Located]
    settlements: list[Located]


def settle(
    records: Iterable[Located],
    policy: Policy,
    *,
    from_ms: int | None = None,
    to_ms: int | None = None,
) -> Settlement:
    """Settle the jobs of ``records`` for the period ``[from_ms, to_ms)`` (None: open)."""

    def inside(at_ms: int) -> bool:
        return (from_ms is None or at_ms >= from_ms) and (to_ms is None or at_ms < to_ms)

    jobs: dict[tuple[str, str], _Job] = {}
    notes: list[str] = []
    for located in records:
        r = located.signed.record
        job = jobs.setdefault((r.line, r.job_id), _Job([], []))
        if r.event == "ran":
            job.ran.append(located)
            if r.kind == "edge":
                job.settlements.append(located)
        elif r.node == r.line:
            job.settlements.append(located)
        else:
            notes.append(
                f"line {located.line}: {r.node!r} settled job {r.job_id!r} of line {r.line!r}; "
                "only a job's own edge settles it: ignored"
            )
    billed: list[Billed] = []
    waste: list[Waste] = []
    unsettled: list[Unsettled] = []
    undelivered = 0
    for key, job in sorted(jobs.items()):
        done = sorted(
            (s for s in job.settlements if to_ms is None or s.signed.record.at_ms < to_ms),
            key=lambda s: (s.signed.record.at_ms, s.line),
        )
        if not done:
            attempts = tuple(
                attempt_of(x, policy) for x in job.ran if inside(x.signed.record.at_ms)
            )
            if attempts:
                unsettled.append(Unsettled(key, attempts))
            continue
        chosen, later = done[0], done[1:]
        for extra in later:
            notes.append(
                f"line {extra.line}: job {key[1]!r} of {key[0]!r} settled again (first on line "
                f"{chosen.line}): the first settlement counts"
            )
        s = chosen.signed.record
        owner = s.owner
        if s.event == "ran":
            settled: Located | None = chosen
            what = f"its own run (line {chosen.line})"
        elif s.settled_node:
            settled = next(
                (
                    x
                    for x in job.ran
                    if x.signed.record.node == s.settled_node
                    and x.signed.record.attempt == s.settled_attempt
                ),
                None,
            )
            what = f"attempt {s.settled_attempt} on {s.settled_node}"
            if settled is None and inside(s.at_ms):
                notes.append(
                    f"line {chosen.line}: job {key[1]!r} of {key[0]!r} settled {what}, whose "
                    "record is not in this export (it ran before its period?): not billed here"
                )
        else:
            settled = None
            what = f"no attempt ({s.status}: nothing delivered)"
            if inside(s.at_ms):
                undelivered += 1
        if settled is not None and inside(s.at_ms):
            billed.append(Billed(attempt_of(settled, policy, owner), s.at_ms, chosen.line))
        for x in job.ran:
            if x is settled or not inside(x.signed.record.at_ms):
                continue
            waste.append(Waste(attempt_of(x, policy, owner), f"the edge settled {what}"))
    return Settlement(
        from_ms=from_ms,
        to_ms=to_ms,
        billed=tuple(billed),
        waste=tuple(sorted(waste, key=lambda w: w.attempt.export_line)),
        unsettled=tuple(unsettled),
        undelivered=undelivered,
        notes=tuple(notes),
    )


@dataclass
class _Row:
    device_s: Decimal = ZERO_S
    jobs: int = 0
    waste_device_s: Decimal = ZERO_S
    waste_attempts: int = 0
    unsettled_jobs: int = 0
    unsettled_device_s: Decimal = ZERO_S


def totals(settlement: Settlement, by: By) -> list[Totals]:
    """One row per value of ``by``, sorted by it (an unsettled job whose attempts fall
    under two values counts under each)."""
    return _totals(settlement, lambda a: a.key(by))


def overall(settlement: Settlement) -> Totals:
    """The period's totals, every job once."""
    rows = _totals(settlement, lambda _: "total")
    return rows[0] if rows else Totals("total")


def _totals(settlement: Settlement, key: Callable[[Attempt], str]) -> list[Totals]:
    rows: dict[str, _Row] = {}
    for b in settlement.billed:
        row = rows.setdefault(key(b.attempt), _Row())
        row.device_s += b.attempt.device_s
        row.jobs += 1
    for w in settlement.waste:
        row = rows.setdefault(key(w.attempt), _Row())
        row.waste_device_s += w.attempt.device_s
        row.waste_attempts += 1
    for u in settlement.unsettled:
        for k in sorted({key(a) for a in u.attempts}):
            row = rows.setdefault(k, _Row())
            row.unsettled_jobs += 1
            row.unsettled_device_s += sum((a.device_s for a in u.attempts if key(a) == k), ZERO_S)
    return [Totals(k, **vars(row)) for k, row in sorted(rows.items())]
