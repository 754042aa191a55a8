"""What becomes of a placed job when its worker dies or a completion for it comes back: pure
decisions over plain records, so that no accepted job is lost and none loops for ever.

* :func:`worker_gone` — does a worker that holds jobs in flight count as dead? Yes if this
  replica saw it alive and has since lost it (Last Will, or silent past the fleet's
  timeout); for a worker this replica never heard from (it restarted, or another replica
  placed the jobs), only once the campus-wide node record in Redis has expired and the
  replica has watched at least one silence timeout itself.
* :func:`after_death` — each job taken from a dead worker (the atomic claim in Redis has
  already counted this crash) becomes a ``worker_lost`` notice, so its edge offers it again
  as the next attempt, or, once ``max_crashes`` workers have died holding it, a
  ``dead_letter`` whose reason names them.
* :func:`judge_completion` — fencing: a completion from an attempt older than the job's
  current one is ``stale`` (counted and audited; it releases only its own worker's
  reservation); the current attempt's completion ends the in-flight record.

No asyncio, Redis or MQTT here, and no clock of its own; ``broker.reaper`` carries the
decisions out and ``broker.inflight`` keeps the records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Cause = Literal["last_will", "silent", "stalled"]
CAUSES: dict[Cause, str] = {
    "last_will": "its Last Will said offline",
    "silent": "its telemetry went silent",
    "stalled": "it completed nothing while holding work, long past its service time",
}


def worker_gone(
    *,
    online: bool,
    seen: bool,
    node_listed: bool,
    watching_s: float,
    stale_after_s: float,
) -> bool:
    """Whether a worker holding jobs in flight is dead.

    ``online``/``seen``: this replica's fleet has it online / has ever had telemetry from it.
    ``node_listed``: its node record (refreshed by every replica from its telemetry, expiring
    after the silence timeout) is still in Redis. ``watching_s``: how long this replica has
    been watching, so a fresh replica does not condemn live workers before their next sample.
    """
    if online:
        return False
    if seen:
        return True
    return not node_listed and watching_s >= stale_after_s


@dataclass(frozen=True, slots=True)
class LostJob:
    """A job taken from a dead worker by the atomic claim, which counted this crash."""

    job_id: str
    edge_id: str
    attempt: int
    crashes: int  # workers that died holding the job, this one included
    crashed_on: tuple[str, ...]  # those workers, oldest first
    deadline_at: float | None  # unix seconds


@dataclass(frozen=True, slots=True)
class Notify:
    """Tell ``edge_id`` what happened to its job: place it again, or stop (dead letter)."""

    job_id: str
    edge_id: str
    kind: Literal["worker_lost", "dead_letter"]
    attempt: int  # the attempt that was lost
    worker_id: str
    crashes: int
    reason: str


def after_death(
    job: LostJob, worker_id: str, *, cause: Cause, max_crashes: int, now: float
) -> Notify:
    """The notice for one job its dead worker held."""
    why = CAUSES[cause]
    late = ""
    if job.deadline_at is not None and job.deadline_at <= now:
        late = f"; its deadline passed {now - job.deadline_at:.1f} s ago"
    if job.crashes >= max_crashes:
        workers = ", ".join(job.crashed_on) or worker_id
        reason = (
            f"dead letter: job {job.job_id} was on {job.crashes} workers that died holding it "
            f"({workers}; the last, {worker_id}: {why}); max_worker_crashes is {max_crashes}, "
            "so it is not placed again"
        )
        kind: Literal["worker_lost", "dead_letter"] = "dead_letter"
    else:
        reason = (
            f"worker {worker_id} was lost holding attempt {job.attempt} ({why}); crash "
            f"{job.crashes} of {max_crashes} allowed: place the job again as attempt "
            f"{job.attempt + 1} or run it locally{late}"
        )
        kind = "worker_lost"
    return Notify(job.job_id, job.edge_id, kind, job.attempt, worker_id, job.crashes, reason)


@dataclass(frozen=True, slots=True)
class Current:
    """A job's in-flight record as a completion finds it."""

    attempt: int
    worker_id: str
    lost: int | None  # the attempt a worker's death was claimed for, if any
    dead: bool  # dead-lettered


Verdict = Literal["current", "stale", "after_loss", "unknown"]


@dataclass(frozen=True, slots=True)
class Judged:
    """What a completion means and what it changes in the in-flight records.

    ``drop``: the job is finished; its record goes if its attempt is still ``attempt``.
    ``unlist``: the completing worker no longer holds the job (out of its in-flight set).
    The completing worker's reservation is released in every case.
    """

    verdict: Verdict
    drop: bool
    unlist: bool
    reason: str


def judge_completion(current: Current | None, *, attempt: int, worker_id: str) -> Judged:
    """Fencing of a completion of ``attempt`` from ``worker_id`` against the job's record."""
    if current is None:
        return Judged("unknown", False, True, "no in-flight record for the job")
    if current.dead:
        reason = (
            f"attempt {attempt} from worker {worker_id} completed after the job was "
            "dead-lettered; its result is not the job's"
        )
        return Judged("stale", False, True, reason)
    if attempt < current.attempt:
        reason = (
            f"attempt {attempt} from worker {worker_id} completed after attempt "
            f"{current.attempt} was placed on {current.worker_id}; discarded"
        )
        # The same worker may hold the current attempt: then its listing is that attempt's.
        return Judged("stale", False, current.worker_id != worker_id, reason)
    if current.lost == attempt == current.attempt:
        reason = (
            f"attempt {attempt} completed on worker {worker_id} after the worker had been "
            "declared lost and its edge told to place the job again"
        )
        # Keep the record: the crash count must survive if the edge asks again.
        return Judged("after_loss", False, True, reason)
    return Judged("current", True, True, f"attempt {attempt} completed on {worker_id}")
