"""Where a missed job's time went, told from the result document its app received and the
latency the app measured: the demo's live view says it per kind of job. Pure: no clock,
no I/O; it must never guess a part the document does not carry.

A job missed its deadline when it came back ``expired``, or ``ok`` after its deadline as
the app measured it. Its time is split into the parts a plant engineer acts on
(:data:`PARTS`); the job is counted in the part that held most of it, and every part's
milliseconds are added up too, since a part that is never a job's largest (a placement's
wait, say) can still take a fifth of each missed job's time. A result its edge concluded
carries its wait on the edge (``queue_ms``) and, when the edge asked the broker, how much
of that went waiting for placements (``placement_ms``) and out on workers
(``offloaded_ms``); the rest of that wait was the line PC's queue. A worker's result, which
the edge forwards as it came, carries only the worker's own times: what the app waited
beyond them went getting to the worker and back (the line PC, the placement, transit),
which that document does not split.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Literal

from sluicegate import wire

Part = Literal["line_pc", "placement", "worker", "compute", "around", "transit"]
PARTS: tuple[Part, ...] = ("line_pc", "placement", "worker", "compute", "around", "transit")
ALWAYS: tuple[Part, ...] = ("line_pc", "placement", "worker")  # said even when 0
WORDS: dict[Part, str] = {
    "line_pc": "queued on the line PC",
    "placement": "waited for a placement",
    "worker": "on the worker",  # in transit to it, queued there, or lost there
    "compute": "computing",  # on the edge or on the worker: whichever answered
    "around": "getting to the worker and back",  # a worker's answer: not split further
    # What the app waited beyond the edge's own span: Mosquitto both ways, the app's side,
    # the result's commit, and the edge's intake before it stamps the job's arrival.
    "transit": "in transit",
}
KEPT = 20000  # times kept per part, for the percentiles


@dataclass(frozen=True)
class Missed:
    """A missed job: the part that held most of its time, how long it was there, and its
    time in every part (:func:`split`)."""

    part: Part
    ms: float
    parts: Mapping[Part, float] = field(default_factory=dict)


def split(result: wire.JobResult, app_ms: float) -> dict[Part, float]:
    """``result``'s time, ``app_ms`` as its app measured it, in milliseconds per part."""
    t = result.timings_ms
    compute = max(0.0, t.total_ms - t.queue_ms)  # started until its result was made
    rest = max(0.0, app_ms - t.total_ms)  # what the app waited beyond the document's span
    if result.ran_on.kind == "pool":
        return {"worker": t.queue_ms, "compute": compute, "around": rest}
    placement = t.placement_ms or 0.0
    away = t.offloaded_ms or 0.0
    line_pc = max(0.0, t.queue_ms - placement - away)
    return {
        "line_pc": line_pc,
        "placement": placement,
        "worker": away,
        "compute": compute,
        "transit": rest,
    }


def missed(result: wire.JobResult, app_ms: float, deadline_ms: float) -> Missed | None:
    """Where a job that missed its deadline spent most of its time; None if it did not
    miss it (in time, or refused or failed: those are not late, they are wrong)."""
    late = result.status == "expired" or (result.status == "ok" and app_ms > deadline_ms)
    if not late:
        return None
    parts = split(result, app_ms)
    part = max(PARTS, key=lambda p: parts.get(p, -1.0))  # ties: the earlier part
    return Missed(part, parts[part], parts)


@dataclass
class Misses:
    """One kind of job's missed jobs, by the part that held most of their time."""

    count: Counter[Part] = field(default_factory=Counter)
    ms: dict[Part, deque[float]] = field(default_factory=dict)
    spent: dict[Part, float] = field(default_factory=dict)  # all their time, by part

    @property
    def total(self) -> int:
        return sum(self.count.values())

    def add(self, miss: Missed) -> None:
        self.count[miss.part] += 1
        self.ms.setdefault(miss.part, deque(maxlen=KEPT)).append(miss.ms)
        for part, ms in miss.parts.items():
            self.spent[part] = self.spent.get(part, 0.0) + ms


def summary(misses: Misses, answered: int) -> str:
    """``missed 12 of 300 (4.0%): 9 queued on the line PC (p50 180 ms), 3 waited for a
    placement (p50 40 ms), 0 on the worker``: the headline parts always, others once seen."""
    share = f" ({100.0 * misses.total / answered:.1f}%)" if answered else ""
    head = f"missed {misses.total} of {answered}{share}"
    if not misses.total:
        return head
    said = []
    for part in PARTS:
        n = misses.count.get(part, 0)
        if not n and part not in ALWAYS:
            continue
        p50 = f" (p50 {median(misses.ms[part]):.0f} ms)" if n else ""
        said.append(f"{n} {WORDS[part]}{p50}")
    return f"{head}: {', '.join(said)}"


def shares(misses: Misses) -> str:
    """``their time: 48% on the worker, 21% getting to the worker and back, ...``: all the
    missed jobs' milliseconds by part, largest first, parts under 1% left out; "" if none."""
    whole = sum(misses.spent.values())
    if not whole:
        return ""
    ranked = sorted(PARTS, key=lambda p: -misses.spent.get(p, 0.0))  # stable: ties in order
    said = [
        f"{100.0 * misses.spent[p] / whole:.0f}% {WORDS[p]}"
        for p in ranked
        if misses.spent.get(p, 0.0) >= 0.01 * whole
    ]
    return f"their time: {', '.join(said)}"
