"""The waiting room: jobs that could not be placed yet, in the order they should get room.

A multi-level feedback queue. A job enters at the level of its priority (0 lowest, 9
highest, as on the wire) and is promoted one level every ``age_step_s`` it waits, with no
ceiling, so it eventually outranks any job that arrived later: nothing starves (a job of
priority p is overtaken only by jobs that arrive less than (10 - p) age steps after it).
Within a level the earliest deadline goes first (no deadline: last), then the earliest
arrival. A job leaves by :meth:`MLFQ.pop_ready` (its turn), :meth:`MLFQ.remove`, or
:meth:`MLFQ.expired` once it has waited ``max_wait_s`` or its deadline has passed; a job
past either bound is never handed out by ``pop_ready``.

Pure and generic over the item a job carries: time is always an argument, nothing reads a
clock or knows what placing a job means. Promotions are processed lazily, in order of
their due time, so every call is O(log n) per job it touches.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Generic, TypeVar

from broker.errors import InvalidParams

T = TypeVar("T")
PRIORITIES = range(10)


@dataclass(frozen=True, slots=True)
class Waiting(Generic[T]):
    """A job waiting for room; times are unix seconds."""

    job_id: str
    priority: int
    deadline_at: float | None
    enqueued_at: float
    item: T


class _Entry(Generic[T]):
    __slots__ = ("expires_at", "job", "level", "seq", "steps")

    def __init__(self, job: Waiting[T], seq: int, expires_at: float) -> None:
        self.job = job
        self.seq = seq
        self.level = job.priority
        self.steps = 0  # promotions so far
        self.expires_at = expires_at


class MLFQ(Generic[T]):
    """Priority levels with ageing; earliest deadline first within a level."""

    def __init__(self, max_wait_s: float, age_step_s: float) -> None:
        if not max_wait_s >= 0.0:
            raise InvalidParams(f"max_wait_s = {max_wait_s!r}; accepted: >= 0")
        if not age_step_s > 0.0:
            raise InvalidParams(f"age_step_s = {age_step_s!r}; accepted: > 0")
        self.max_wait_s = max_wait_s
        self.age_step_s = age_step_s
        self._jobs: dict[str, _Entry[T]] = {}
        self._levels: dict[int, list[tuple[float, float, int, str]]] = {}
        self._promotions: list[tuple[float, int, str]] = []
        self._expiry: list[tuple[float, int, str]] = []
        self._expired: list[Waiting[T]] = []  # found past a bound, not yet handed out
        self._seq = 0

    def __len__(self) -> int:
        return len(self._jobs) + len(self._expired)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def push(self, job: Waiting[T], now: float) -> bool:
        """Add ``job`` (keeping its ``enqueued_at``, so a job put back keeps its age).
        False if a job with that id is already waiting (a redelivered request)."""
        if job.priority not in PRIORITIES:
            raise InvalidParams(f"priority = {job.priority!r}; accepted: 0 to 9")
        if job.job_id in self._jobs:
            return False
        self._advance(now)
        self._seq += 1
        deadline = job.deadline_at if job.deadline_at is not None else math.inf
        entry = _Entry(job, self._seq, min(job.enqueued_at + self.max_wait_s, deadline))
        self._jobs[job.job_id] = entry
        heapq.heappush(self._expiry, (entry.expires_at, entry.seq, job.job_id))
        heapq.heappush(self._promotions, (job.enqueued_at + self.age_step_s, entry.seq, job.job_id))
        self._file(entry)
        self._advance(now)  # a job put back may already be due promotions
        return True

    def remove(self, job_id: str) -> bool:
        """Take a job out without handing it to anyone (it was placed another way)."""
        return self._jobs.pop(job_id, None) is not None

    def peek(self, now: float) -> Waiting[T] | None:
        """The job whose turn it is at ``now``, left in place."""
        found = self._top(now)
        return found[1].job if found is not None else None

    def pop_ready(self, now: float) -> Waiting[T] | None:
        """Take the job whose turn it is at ``now``: highest level after ageing, then
        earliest deadline, then earliest arrival. None when no job is within its bounds."""
        found = self._top(now)
        if found is None:
            return None
        level, entry = found
        heapq.heappop(self._levels[level])
        del self._jobs[entry.job.job_id]
        return entry.job

    def expired(self, now: float) -> list[Waiting[T]]:
        """Take every job that waited ``max_wait_s`` or whose deadline passed, oldest bound
        first; the shell answers each with a refusal."""
        self._collect(now)
        out, self._expired = self._expired, []
        return out

    def levels(self, now: float) -> dict[int, int]:
        """Waiting jobs per effective level at ``now`` (for metrics)."""
        self._advance(now)
        counts: dict[int, int] = {}
        for entry in self._jobs.values():
            counts[entry.level] = counts.get(entry.level, 0) + 1
        return dict(sorted(counts.items()))

    # -- internals ----------------------------------------------------------------------------

    def _live(self, job_id: str, seq: int) -> _Entry[T] | None:
        entry = self._jobs.get(job_id)
        return entry if entry is not None and entry.seq == seq else None

    def _file(self, entry: _Entry[T]) -> None:
        job = entry.job
        deadline = job.deadline_at if job.deadline_at is not None else math.inf
        heap = self._levels.setdefault(entry.level, [])
        heapq.heappush(heap, (deadline, job.enqueued_at, entry.seq, job.job_id))

    def _advance(self, now: float) -> None:
        """Process every promotion due by ``now``, in due order."""
        promotions = self._promotions
        while promotions and promotions[0][0] <= now:
            _, seq, job_id = heapq.heappop(promotions)
            entry = self._live(job_id, seq)
            if entry is None:
                continue
            entry.steps += 1
            entry.level = entry.job.priority + entry.steps
            self._file(entry)
            due = entry.job.enqueued_at + (entry.steps + 1) * self.age_step_s
            heapq.heappush(promotions, (due, seq, job_id))

    def _collect(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, seq, job_id = heapq.heappop(expiry)
            entry = self._live(job_id, seq)
            if entry is not None:
                del self._jobs[job_id]
                self._expired.append(entry.job)

    def _top(self, now: float) -> tuple[int, _Entry[T]] | None:
        self._collect(now)
        self._advance(now)
        for level in sorted(self._levels, reverse=True):
            heap = self._levels[level]
            while heap:
                _, _, seq, job_id = heap[0]
                entry = self._live(job_id, seq)
                if entry is not None and entry.level == level:
                    return level, entry
                heapq.heappop(heap)
            del self._levels[level]
        return None
