"""A trace of the demo campus's traffic without running it: arrivals only.

The same traffic as :mod:`sluicegate.app.traffic` (wafers and metal parts to the detector
within 200 ms, one image in ``label_every`` a label to OCR within 1 s; ``rate`` images/s
per line, line 1 at ten times that in volleys of 20 while a burst lasts) on the demo
campus's nodes and policy, with the service times ``sluicegate models bench`` measured for
the shipped models on this project's reference machine (a line PC held to 15 % of a core;
workers on one core each). It has no outcomes, so a replay draws every time from the
nodes' figures: for rehearsing changes at sizes no one wants to record (a 10-minute
campus), and for tests. A recorded trace (``sluicegate twin record``) is what predicts a
real campus.
"""

from __future__ import annotations

import functools
import hashlib
import tempfile
from pathlib import Path

import numpy as np

from broker.core.params import PlacementParams
from policies.keys import SigningKey
from sluicegate.app.campus import LINES, WORKERS, write_campus
from sluicegate.app.traffic import KINDS, LABELS, PARTS, VOLLEY, WAFERS
from sluicegate.twin.trace import EdgeSpec, Header, JobRecord, Trace, WorkerSpec, policy_field

# ms per job: an edge's model threads at 15 % of a core; a worker, amortised at batch 8.
EDGE_MS = {"surface-det": 38.8, "ocr-ppocrv4": 331.9, "defect-v1": 1.6}
WORKER_MS = {"surface-det": 3.3, "ocr-ppocrv4": 48.8, "defect-v1": 0.43}
BYTES = {WAFERS.name: 52_000, PARTS.name: 48_000, LABELS.name: 21_000}
STARTED_AT = 1_796_000_000.0  # a fixed clock reading: the same arguments, the same trace


@functools.cache
def demo_policy() -> str:
    """The demo campus's policy text, with signing keys derived from the nodes' names (the
    workers' sealing keys are made afresh once per process, as ``write_campus`` makes them)."""

    def key_for(name: str) -> SigningKey:
        return SigningKey.from_seed(hashlib.sha256(f"twin-demo/{name}".encode()).digest())

    with tempfile.TemporaryDirectory(prefix="sg-twin-") as tmp:
        campus = write_campus(
            Path(tmp), key_for, mqtt_port=1, redis_url="redis://x", now=STARTED_AT, secure=False
        )
        return campus.policy_file.read_text()


def demo_header() -> Header:
    edges = [
        EdgeSpec(id=e, zone=z, concurrency=2, queue_size=256, queue_bound=32, service_ms=EDGE_MS)
        for e, z in LINES.items()
    ]
    workers = [
        WorkerSpec(
            id=w,
            zone=zone,
            device_class=cls,
            models=dict.fromkeys(WORKER_MS),
            capacity=512 + 2 * 8,
            max_batch=8,
            concurrency=2,
            service_ms=WORKER_MS,
        )
        for w, (zone, cls) in WORKERS.items()
    ]
    return Header(
        started_at=STARTED_AT,
        source="synthetic",
        policy=policy_field(demo_policy(), source="the demo's policy"),
        params=PlacementParams().describe(),
        edges=edges,
        workers=workers,
    )


def demo_trace(
    seconds: float,
    *,
    rate: float = 10.0,
    bursts: tuple[tuple[float, float], ...] = ((5.0, 10.0),),
    label_every: int = 16,
    seed: int = 2026,
) -> Trace:
    """``seconds`` of the demo's traffic; ``bursts``: (start s, length s) of line 1's 10x."""
    rng = np.random.default_rng(seed)
    jobs: list[JobRecord] = []
    count = 0
    for edge in LINES:
        t = 0.0
        while t < seconds:
            burst = edge == "line-1-pc" and any(a <= t < a + n for a, n in bursts)
            volley = VOLLEY if burst else 1
            for _ in range(volley):
                count += 1
                if label_every and count % label_every == 0:
                    kind = LABELS
                else:
                    kind = WAFERS if rng.random() < 0.4 else PARTS
                jobs.append(
                    JobRecord(
                        at=round(t, 6),
                        edge=edge,
                        job_id=f"{edge}-{count:07d}",
                        model=kind.model,
                        data_class=kind.data_class,
                        deadline_ms=kind.deadline_ms,
                        bytes=BYTES[kind.name],
                    )
                )
            t += volley / (rate * (10.0 if burst else 1.0))
    jobs.sort(key=lambda j: (j.at, j.job_id))
    return Trace(demo_header(), tuple(jobs))


__all__ = ["KINDS", "demo_header", "demo_policy", "demo_trace"]
