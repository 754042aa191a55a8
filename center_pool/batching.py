"""Dynamic batching: the pure decision of which waiting jobs run together, and when.

Jobs wait in one group per model. A group is *ready* when it holds ``max_batch`` jobs
(``full``), when its oldest job has waited ``window_s`` (``window``), or when one of its jobs
must start now to meet its deadline (``deadline``: each entry carries ``start_by``, its
deadline minus the model's expected run time). While the executor is busy, ready groups keep
growing, so batches get larger exactly when the worker is loaded. Among ready groups the most
urgent goes first (earliest ``start_by``, then oldest); within a group, higher priority, then
earlier ``start_by``, then arrival order.

Pure bookkeeping: the clock is passed in, nothing here runs models, sleeps or arms timers
(the shell asks :meth:`BatchQueue.ready_at` and arms its own).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

T = TypeVar("T")

FlushReason = Literal["full", "window", "deadline", "drain"]


@dataclass(frozen=True, slots=True)
class Entry(Generic[T]):
    """One waiting job; times are seconds on the caller's clock."""

    item: T
    model: str
    arrived: float
    priority: int = 5
    start_by: float | None = None


@dataclass(frozen=True, slots=True)
class Batch(Generic[T]):
    """Same-model jobs to run in one ``session.run``."""

    model: str
    items: tuple[T, ...]
    reason: FlushReason


@dataclass(slots=True)
class _Group(Generic[T]):
    entries: list[tuple[int, Entry[T]]]

    def oldest(self) -> float:
        return min(e.arrived for _, e in self.entries)

    def start_by(self) -> float:
        return min(
            (e.start_by for _, e in self.entries if e.start_by is not None), default=math.inf
        )


class BatchQueue(Generic[T]):
    """Waiting jobs grouped by model, bounded by ``capacity`` jobs in all."""

    def __init__(self, *, max_batch: int, window_s: float, capacity: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch!r}")
        if window_s < 0 or not math.isfinite(window_s):
            raise ValueError(f"window_s must be a finite number >= 0, got {window_s!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity!r}")
        self.max_batch = max_batch
        self.window_s = window_s
        self.capacity = capacity
        self._groups: dict[str, _Group[T]] = {}
        self._size = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._size

    def depth(self, model: str) -> int:
        group = self._groups.get(model)
        return len(group.entries) if group else 0

    def depths(self) -> dict[str, int]:
        """Waiting jobs by model."""
        return {model: len(group.entries) for model, group in self._groups.items()}

    def push(self, entry: Entry[T]) -> bool:
        """Queue ``entry``; False (and nothing queued) when ``capacity`` jobs already wait."""
        if self._size >= self.capacity:
            return False
        self._seq += 1
        self._groups.setdefault(entry.model, _Group([])).entries.append((self._seq, entry))
        self._size += 1
        return True

    def _due(self, group: _Group[T]) -> tuple[float, FlushReason]:
        if len(group.entries) >= self.max_batch:
            return -math.inf, "full"
        window = group.oldest() + self.window_s
        start_by = group.start_by()
        if start_by < window:
            return start_by, "deadline"
        return window, "window"

    def ready_at(self) -> float | None:
        """The earliest moment some group is ready (may be in the past); None when empty."""
        if not self._groups:
            return None
        return min(self._due(g)[0] for g in self._groups.values())

    def pop(self, now: float, *, drain: bool = False) -> Batch[T] | None:
        """The most urgent ready batch, or None if no group is ready at ``now``.

        With ``drain`` every group counts as ready (shutting down: run what is left).
        """
        best: tuple[tuple[float, float], str, FlushReason] | None = None
        for model, group in self._groups.items():
            due, reason = self._due(group)
            if due > now and not drain:
                continue
            if due > now:
                reason = "drain"
            urgency = (group.start_by(), group.oldest())
            if best is None or urgency < best[0]:
                best = (urgency, model, reason)
        if best is None:
            return None
        _, model, reason = best
        group = self._groups[model]
        if len(group.entries) <= self.max_batch:
            taken = sorted(group.entries, key=_order)
            del self._groups[model]
        else:  # the rest keeps arrival order; picking costs O(n log max_batch)
            taken = heapq.nsmallest(self.max_batch, group.entries, key=_order)
            chosen = {seq for seq, _ in taken}
            group.entries = [pair for pair in group.entries if pair[0] not in chosen]
        self._size -= len(taken)
        return Batch(model, tuple(e.item for _, e in taken), reason)


@dataclass(frozen=True, slots=True)
class Ready(Generic[T]):
    """A batch to start now: the jobs that run, and those whose deadline passed while they
    waited (each answered ``expired``, never run)."""

    model: str
    live: list[T]
    expired: list[T]


def ready_batches(
    queue: BatchQueue[T],
    now: float,
    slots: int,
    deadline_of: Callable[[T], float | None],
    *,
    drain: bool = False,
) -> list[Ready[T]]:
    """The batches a worker with ``slots`` free compute slots starts at ``now``, the most
    urgent first: each ready batch split into its live jobs and its expired ones; a batch
    with no live job takes no slot. The worker's dispatcher and the twin's workers both
    start their batches by it."""
    out: list[Ready[T]] = []
    started = 0
    while started < slots:
        batch = queue.pop(now, drain=drain)
        if batch is None:
            break
        live: list[T] = []
        expired: list[T] = []
        for item in batch.items:
            deadline = deadline_of(item)
            (expired if deadline is not None and now >= deadline else live).append(item)
        out.append(Ready(batch.model, live, expired))
        started += bool(live)
    return out


def start_by(deadline: float | None, now: float, batch_estimate_s: float | None) -> float | None:
    """When a job must start to meet ``deadline``: its deadline less the model's expected
    batch time; at once when no batch time is measured yet (a job with a deadline does not
    wait for company), never when it has no deadline."""
    if deadline is None:
        return None
    return now if batch_estimate_s is None else deadline - batch_estimate_s


def _order(pair: tuple[int, Entry[T]]) -> tuple[int, float, int]:
    seq, entry = pair
    start_by = entry.start_by if entry.start_by is not None else math.inf
    return (-entry.priority, start_by, seq)
