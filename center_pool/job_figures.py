"""What a pool worker counts of the jobs it returns, for its Prometheus metrics: jobs by
model and status, each run job's service time, each batch's size, and the slot-seconds its
batches kept busy.

Counted where the worker concludes each job (``Dispatcher._completed`` and its expiry), next
to the result it returns. Pure: no clock (the caller passes the times), no metrics library;
``center_pool.metrics`` reads these figures at scrape time.
"""

from __future__ import annotations

from collections import Counter

from sluicegate.buckets import BATCH, Buckets


class WorkFigures:
    """Jobs returned, service times and batch sizes by model; busy slot-seconds."""

    def __init__(self) -> None:
        self.jobs: Counter[tuple[str, str]] = Counter()  # by (model, status)
        self.seconds: dict[str, Buckets] = {}  # service time of each job run, by model
        self.batches: dict[str, Buckets] = {}  # jobs per batch run, by model
        self.busy_s = 0.0  # seconds of batch slots busy, summed over the slots

    def returned(self, model: str, status: str, service_s: float | None = None) -> None:
        """A job of ``model`` returned with ``status``; ``service_s``: its decode,
        preprocess and (its batch's) inference, when it ran."""
        self.jobs[(model, status)] += 1
        if service_s is not None:
            if model not in self.seconds:
                self.seconds[model] = Buckets()
            self.seconds[model].observe(max(0.0, service_s))

    def batch(self, model: str, size: int, busy_s: float) -> None:
        """A batch of ``size`` jobs of ``model`` ran, holding a slot ``busy_s`` seconds."""
        if model not in self.batches:
            self.batches[model] = Buckets(BATCH)
        self.batches[model].observe(size)
        self.busy_s += max(0.0, busy_s)
