"""One fault scenario: a burst of jobs at an edge, a fault when a condition on the campus's
traffic holds, then a bounded wait for every accepted job's result.

The trigger reads the app's ledger and the observer's timeline (e.g. "the worker holds
three jobs" or "the broker is answering placements"), so the fault lands mid-burst by
construction rather than after a guessed delay. The fault itself is an async callable that
may block (it runs kills and restarts in a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tests.faults.app import App, Observer, Timeline
from tests.faults.ledger import Ledger, Verdict
from tests.faults.rig import WIRETAP, Rig, burst

Trigger = Callable[[Ledger, Timeline], bool]
Fault = Callable[[App, Observer], Awaitable[None]]


@dataclass
class Outcome:
    verdict: Verdict
    timeline: Timeline
    triggered: bool
    missing: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    started: float = 0.0  # time.monotonic() when the burst began
    pending_at_fault: int = 0  # accepted jobs still without a result when the fault struck

    def trace(self, job_id: str) -> str:
        """What the campus's traffic shows of one job, times from the burst's start."""
        steps = [
            f"{e.at - self.started:.3f}s {e.kind} {e.node}"
            + (f" attempt {e.attempt}" if e.attempt is not None else "")
            + (f" {e.detail}" if e.detail else "")
            for e in self.timeline.events
            if e.job_id == job_id
        ]
        return f"{job_id}: " + ("; ".join(steps) or "no placement, work or return seen")

    def diagnose(self, rig: Rig, limit: int = 5) -> str:
        """Traces and node log lines of the first lost jobs, and when things happened."""
        lines = [f"phases (s): {', '.join(f'{k} {v:.2f}' for k, v in self.seconds.items())}"]
        statuses = [
            f"{e.at - self.started:.3f}s {e.node} {e.detail}"
            for e in self.timeline.events
            if e.kind == "status"
        ]
        lines.append("live status changes: " + ("; ".join(statuses) or "none"))
        for job_id in self.verdict.lost[:limit]:
            lines.append(self.trace(job_id))
            lines.append(f"  outbox: {outbox_row(rig, job_id)}")
            for node in rig.campus.nodes:
                log = rig.root / "campus" / f"{node}.log"
                if log.exists():
                    hits = [
                        line
                        for line in log.read_text(errors="replace").splitlines()
                        if f"{job_id} " in line or line.endswith(job_id)
                    ]
                    lines += [f"  {node}: {hit}" for hit in hits[:6]]
        return "\n".join(lines)


async def run_fault(
    rig: Rig,
    fault: Fault,
    trigger: Trigger,
    *,
    edge: str = "line-1-pc",
    jobs: int = 240,
    volley: int = 6,
    every_s: float = 0.05,
    trigger_timeout: float = 20.0,
    settle_timeout: float = 30.0,
    prefix: str = "job",
) -> Outcome:
    """Burst ``jobs`` at ``edge``; run ``fault`` once ``trigger`` holds; wait for results."""
    app = await App(rig.mqtt()).start()
    observer = await Observer(rig.mqtt(WIRETAP)).start()
    t0 = time.monotonic()
    seconds: dict[str, float] = {}
    try:
        load = asyncio.ensure_future(
            burst(app, edge, prefix, jobs=jobs, volley=volley, every_s=every_s)
        )
        triggered = await _wait(app.ledger, observer, trigger, trigger_timeout, load)
        seconds["trigger"] = time.monotonic() - t0
        pending_at_fault = len(app.ledger.pending())
        if triggered:
            await fault(app, observer)
        seconds["fault_done"] = time.monotonic() - t0
        await load
        seconds["burst_done"] = time.monotonic() - t0
        missing = await app.wait_results(settle_timeout)
        seconds["settled"] = time.monotonic() - t0
        return Outcome(
            app.ledger.verdict(),
            observer.timeline,
            triggered,
            missing,
            seconds,
            t0,
            pending_at_fault,
        )
    finally:
        await observer.close()
        await app.close()


async def _wait(
    ledger: Ledger,
    observer: Observer,
    trigger: Trigger,
    timeout: float,
    load: asyncio.Future[list[str]],
) -> bool:
    """True once ``trigger`` held (even for one event only); False if the burst ended or
    the time ran out first."""
    held = False

    def check(timeline: Timeline) -> bool:
        nonlocal held
        held = held or trigger(ledger, timeline)
        return held or load.done()

    await observer.wait_for(check, timeout)
    return held


def answered(n: int) -> Trigger:
    """Holds once ``n`` jobs have at least one result."""
    return lambda ledger, _tl: sum(1 for j in ledger.jobs.values() if j.deliveries) >= n


def seen(kind: str, n: int, node: str | None = None) -> Trigger:
    """Holds once the observer saw ``n`` events of ``kind`` (from ``node``)."""
    return lambda _ledger, tl: tl.count(kind, node) >= n


def outbox_row(rig: Rig, job_id: str) -> str:
    """What the edges' outbox files say of ``job_id`` (read once the rig has stopped; a
    running edge holds its file exclusively). For diagnosis only: the file's layout is the
    edge's business, so anything unexpected is reported, not raised."""
    found = []
    for db in sorted((rig.root / "campus" / "state").glob("*/*.outbox.db")):
        try:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
                row = conn.execute(
                    "SELECT state, attempt, local_runs, result IS NOT NULL FROM jobs "
                    "WHERE job_id = ?",
                    (job_id,),
                ).fetchone()
        except sqlite3.Error as exc:
            found.append(f"{db.name}: unreadable ({exc})")
            continue
        if row is not None:
            state, attempt, runs, has_result = row
            found.append(
                f"{db.name}: state {state}, attempt {attempt}, local runs {runs}, "
                f"result stored {bool(has_result)}"
            )
    return "; ".join(found) or "in no outbox"
