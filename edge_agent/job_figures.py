"""What the edge counts of each concluded job for its Prometheus metrics, beyond the answers
by status: whether a job with a deadline left the edge by it, how long an ok job's parts
took (the same parts its twin record has, ``edge_agent.trace_log``), and why an ok job that
ran here was not offloaded.

Counted once per job, where its result is published (``Carrier._publish``), whether or not
``trace_jobs`` keeps records. Pure: no clock (the caller says when the result left), no
metrics library; ``edge_agent.metrics`` reads these figures at scrape time.
"""

from __future__ import annotations

from collections import Counter

from edge_agent.admission import Job
from sluicegate import wire
from sluicegate.buckets import Buckets

# The code of an ok job that ran here without the edge ever offering it (in time here, the
# queue short, or offloading off): its result carries no ``offload`` field.
NOT_OFFERED = "not_offered"
PARTS = ("total", "queue", "inference", "transfer")  # transfer: pool jobs only


def stayed_code(result: wire.JobResult) -> str:
    """Why an ok job that ran here did not leave: the result's code, else its offload code
    (as its trace record says), else :data:`NOT_OFFERED`."""
    if result.code is not None:
        return result.code
    if result.offload is not None and result.offload.code is not None:
        return result.offload.code
    return NOT_OFFERED


class JobFigures:
    """Deadlines met and missed, part times by where jobs ran, local jobs by why."""

    def __init__(self) -> None:
        self.deadline: Counter[str] = Counter()  # met, missed
        self.stayed_local: Counter[str] = Counter()  # by code
        self.seconds: dict[tuple[str, str], Buckets] = {}  # by (ran_on, part)

    def concluded(self, job: Job, result: wire.JobResult, *, left_at: float) -> None:
        """Count ``job``, concluded with ``result``, which left the edge at ``left_at``."""
        if job.deadline is not None:
            self.deadline["met" if left_at <= job.deadline else "missed"] += 1
        if result.status != "ok":
            return
        ran_on = result.ran_on.kind
        times = result.timings_ms
        total = max(0.0, left_at - job.received_at)
        queue = max(0.0, times.queue_ms / 1000.0)
        inference = max(0.0, times.inference_ms / 1000.0)
        self._observe(ran_on, "total", total)
        self._observe(ran_on, "queue", queue)
        self._observe(ran_on, "inference", inference)
        if ran_on == "pool":
            self._observe(ran_on, "transfer", max(0.0, total - queue - inference))
        else:
            self.stayed_local[stayed_code(result)] += 1

    def _observe(self, ran_on: str, part: str, seconds: float) -> None:
        key = (ran_on, part)
        if key not in self.seconds:
            self.seconds[key] = Buckets()
        self.seconds[key].observe(seconds)
