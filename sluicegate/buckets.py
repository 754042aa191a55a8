"""A histogram as plain figures: cumulative bucket counts, their sum and count, kept where a
node counts what it did, so the Prometheus collectors (``edge_agent.metrics``,
``center_pool.metrics``) read the very figures at scrape time instead of keeping copies.

Pure: no clock, no I/O, no metrics library. The bounds are fixed at creation; a value past
the last bound counts only in ``+Inf`` (the total count).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

# Seconds, from a fast local classifier to a slow offloaded detector with a queue.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Jobs per batch.
BATCH = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One histogram at one moment: ``(upper bound, cumulative count)`` per bucket, the
    ``+Inf`` bucket being ``count``."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    total: float


class Buckets:
    """Observations counted into fixed buckets."""

    def __init__(self, bounds: Sequence[float] = SECONDS) -> None:
        ordered = tuple(float(b) for b in bounds)
        if not ordered or list(ordered) != sorted(set(ordered)):
            raise ValueError(f"bucket bounds must be strictly increasing, got {list(bounds)}")
        self.bounds = ordered
        self._counts = [0] * len(ordered)  # per bucket, not cumulative
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        at = bisect_left(self.bounds, value)  # value <= bounds[at]: Prometheus's "le"
        if at < len(self._counts):
            self._counts[at] += 1
        self.count += 1
        self.total += value

    def snapshot(self) -> Snapshot:
        running = 0
        cumulative = []
        for bound, n in zip(self.bounds, self._counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return Snapshot(tuple(cumulative), self.count, self.total)
