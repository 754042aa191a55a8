"""What a replay says, and two replays side by side.

:func:`summarise` turns a :class:`~sluicegate.twin.sim.Result` into plain figures: deadline
attainment overall, per line and per data class; latency p50/p99 of the answered jobs;
the share offloaded; per worker its utilisation (compute time over its slots' time) and the
peak of the jobs it held; per pool the peak of the scaling signal's desired workers and when
it was first reached (:mod:`sluicegate.twin.signal`, announced work included); refusals by
reason; where each data class ran, by zone (a sister campus's as ``<zone>@<campus>``); what
was asked of each sister campus and what it answered; and placements the run's policy or
an agreement forbids.
:func:`compare` puts a baseline and a candidate side by side, with the jobs whose node
changed, and :func:`render` prints it as a table. All pure and deterministic: equal results
give equal text and equal JSON.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from sluicegate.twin.signal import Reading
from sluicegate.twin.sim import Result


@dataclass(frozen=True)
class Summary:
    jobs: int
    attainment: float
    by_line: dict[str, float]
    by_class: dict[str, float]
    p50_ms: float
    p99_ms: float
    offload_ratio: float
    utilisation: dict[str, float]
    peak_depth: dict[str, int]
    statuses: dict[str, int]
    refusals: dict[str, int]
    zones: dict[str, dict[str, int]]
    violations: int
    # pool -> (its peak desired workers, the first s it reached it), from the scaling signal
    desired_workers: dict[str, tuple[int, float]] = field(default_factory=dict)
    # sister campus -> its asks' outcomes and the images sent there
    peers: dict[str, dict[str, int]] = field(default_factory=dict)


def _share(hits: int, total: int) -> float:
    return round(hits / total, 4) if total else 0.0


def _attainment(result: Result, key: str) -> dict[str, float]:
    total: Counter[str] = Counter()
    hits: Counter[str] = Counter()
    for o in result.outcomes:
        k = getattr(o, key)
        total[k] += 1
        hits[k] += o.in_time
    return {k: _share(hits[k], total[k]) for k in sorted(total)}


def summarise(result: Result) -> Summary:
    outcomes = result.outcomes
    answered = [o.latency_ms for o in outcomes if o.status == "ok"]
    p50, p99 = np.percentile(answered, [50, 99]) if answered else (0.0, 0.0)
    return Summary(
        jobs=len(outcomes),
        attainment=_share(sum(o.in_time for o in outcomes), len(outcomes)),
        by_line=_attainment(result, "edge"),
        by_class=_attainment(result, "data_class"),
        p50_ms=round(float(p50), 2),
        p99_ms=round(float(p99), 2),
        offload_ratio=_share(sum(o.offloaded for o in outcomes), len(outcomes)),
        utilisation={
            w: round(busy / (result.slots[w] * result.duration_s), 4)
            for w, busy in sorted(result.busy_s.items())
        },
        peak_depth={n: max((d for _, d in s), default=0) for n, s in sorted(result.depth.items())},
        statuses=dict(sorted(Counter(o.status for o in outcomes).items())),
        refusals=result.refusals,
        zones=result.zones,
        violations=result.violations,
        desired_workers={pool: _peak(readings) for pool, readings in result.signal.items()},
        peers=result.peers,
    )


def _peak(readings: tuple[Reading, ...]) -> tuple[int, float]:
    top = max((r.desired_workers for r in readings), default=0)
    return top, next((r.at for r in readings if r.desired_workers == top), 0.0)


class Move(NamedTuple):
    """Jobs of one class from one line that ran on another node in the candidate (the
    fields of ``policies.verdict.Moved``, which words it)."""

    data_class: str
    line: str
    before: str | None  # the node that ran them in the baseline (None: none)
    after: str | None  # ... and in the candidate
    jobs: int


@dataclass(frozen=True)
class Comparison:
    baseline: Summary
    candidate: Summary
    changed: int  # jobs of the baseline that ran on another node (or not at all) in the candidate
    changed_by_class: dict[str, int]
    moves: list[Move]  # those jobs by class, line and nodes: the largest moves first

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=2)


def compare(baseline: Result, candidate: Result) -> Comparison:
    where = {o.job_id: o.where for o in candidate.outcomes}
    moves: Counter[tuple[str, str, str | None, str | None]] = Counter()
    for o in baseline.outcomes:
        after = where.get(o.job_id, o.where)
        if after != o.where:
            moves[(o.data_class, o.edge, o.where, after)] += 1
    moved: Counter[str] = Counter()
    for (data_class, *_), jobs in moves.items():
        moved[data_class] += jobs
    ranked = sorted(moves.items(), key=lambda kv: (-kv[1], [str(k) for k in kv[0]]))
    return Comparison(
        summarise(baseline),
        summarise(candidate),
        sum(moved.values()),
        dict(sorted(moved.items())),
        [Move(*key, jobs) for key, jobs in ranked],
    )


def _pct(x: float) -> str:
    return f"{x * 100:.1f} %"


def _rows(c: Comparison) -> list[tuple[str, str, str]]:
    b, k = c.baseline, c.candidate
    rows = [
        ("jobs", str(b.jobs), str(k.jobs)),
        ("deadline attainment", _pct(b.attainment), _pct(k.attainment)),
    ]
    for line in sorted(set(b.by_line) | set(k.by_line)):
        rows.append((f"  {line}", _pct(b.by_line.get(line, 0)), _pct(k.by_line.get(line, 0))))
    for cls in sorted(set(b.by_class) | set(k.by_class)):
        rows.append((f"  {cls}", _pct(b.by_class.get(cls, 0)), _pct(k.by_class.get(cls, 0))))
    rows += [
        (
            "latency p50 / p99 ms",
            f"{b.p50_ms:.1f} / {b.p99_ms:.1f}",
            f"{k.p50_ms:.1f} / {k.p99_ms:.1f}",
        ),
        ("offloaded", _pct(b.offload_ratio), _pct(k.offload_ratio)),
    ]
    for w in sorted(set(b.utilisation) | set(k.utilisation)):
        bu, ku = b.utilisation.get(w), k.utilisation.get(w)
        rows.append(
            (
                f"  {w} utilisation",
                _pct(bu) if bu is not None else "-",
                _pct(ku) if ku is not None else "-",
            )
        )
    for n in sorted(set(b.peak_depth) | set(k.peak_depth)):
        rows.append(
            (f"  {n} peak jobs held", str(b.peak_depth.get(n, "-")), str(k.peak_depth.get(n, "-")))
        )
    for pool in sorted(set(b.desired_workers) | set(k.desired_workers)):
        bp, kp = b.desired_workers.get(pool), k.desired_workers.get(pool)
        rows.append(
            (
                f"  {pool} desired workers (peak, at s)",
                f"{bp[0]} at {bp[1]:g}" if bp else "-",
                f"{kp[0]} at {kp[1]:g}" if kp else "-",
            )
        )
    for status in sorted(set(b.statuses) | set(k.statuses)):
        rows.append(
            (f"status {status}", str(b.statuses.get(status, 0)), str(k.statuses.get(status, 0)))
        )
    for code in sorted(set(b.refusals) | set(k.refusals)):
        rows.append(
            (f"refused: {code}", str(b.refusals.get(code, 0)), str(k.refusals.get(code, 0)))
        )
    for cls in sorted(set(b.zones) | set(k.zones)):
        for zone in sorted(set(b.zones.get(cls, {})) | set(k.zones.get(cls, {}))):
            rows.append(
                (
                    f"{cls} in {zone}",
                    str(b.zones.get(cls, {}).get(zone, 0)),
                    str(k.zones.get(cls, {}).get(zone, 0)),
                )
            )
    for peer in sorted(set(b.peers) | set(k.peers)):
        was, now = b.peers.get(peer, {}), k.peers.get(peer, {})
        for what in sorted(set(was) | set(now)):
            rows.append((f"sister {peer}: {what}", str(was.get(what, 0)), str(now.get(what, 0))))
    rows += [
        ("placements the policy forbids", str(b.violations), str(k.violations)),
        ("jobs that ran elsewhere", "", str(c.changed)),
    ]
    return rows


def render(c: Comparison, names: tuple[str, str] = ("baseline", "candidate")) -> str:
    rows = [("", *names), *_rows(c)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}".rstrip() for r in rows
    )


def strategy_table(results: Mapping[str, Result]) -> str:
    """Placement strategies on one trace: attainment, p99, offloaded, refused, forbidden."""
    lines = [
        f"{'strategy':<14}{'attain':>9}{'p50 ms':>9}{'p99 ms':>9}{'offl.':>8}"
        f"{'expired':>9}{'forbidden':>10}"
    ]
    for name, result in results.items():
        s = summarise(result)
        lines.append(
            f"{name:<14}{s.attainment:9.3f}{s.p50_ms:9.1f}{s.p99_ms:9.1f}"
            f"{s.offload_ratio:8.3f}{s.statuses.get('expired', 0):9d}{s.violations:10d}"
        )
    return "\n".join(lines)
