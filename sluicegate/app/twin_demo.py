"""A trace of the demo campus's traffic without running it: arrivals only.

The same traffic as :mod:`sluicegate.app.traffic` (wafers and metal parts to the detector
within 200 ms, one image in ``label_every`` a label to OCR within 1 s; ``rate`` images/s
per line, line 1 at ten times that in volleys of 20 while a burst lasts) on the demo
campus's nodes and policy, with the service times ``sluicegate models bench`` measured for
the shipped models on this project's reference machine (a line PC held to 15 % of a core;
workers on one core each). It has no outcomes, so a replay draws every time from the
nodes' figures: for rehearsing changes at sizes no one wants to record (a 10-minute
campus), and for tests. A recorded trace (``sluicegate twin record``) is what predicts a
real campus. :func:`write_sister` writes what rehearsing an agreement with a sister campus
takes: the demo campus's policy naming the sister, and a ``--peer`` file for it (its own
policy, the workers it lends, the link).
"""

from __future__ import annotations

import functools
import hashlib
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from broker.core.params import PlacementParams
from policies.keys import SigningKey
from sluicegate.app.campus import LINES, WORKERS, write_campus
from sluicegate.app.pair import FABS, SOUTH, SOUTH_DC, peer_table
from sluicegate.app.traffic import KINDS, LABELS, PARTS, VOLLEY, WAFERS
from sluicegate.twin.trace import EdgeSpec, Header, JobRecord, Trace, WorkerSpec, policy_field

# ms per job: an edge's model threads at 15 % of a core; a worker, amortised at batch 8.
EDGE_MS = {"surface-det": 38.8, "ocr-ppocrv4": 331.9, "defect-v1": 1.6}
WORKER_MS = {"surface-det": 3.3, "ocr-ppocrv4": 48.8, "defect-v1": 0.43}
BYTES = {WAFERS.name: 52_000, PARTS.name: 48_000, LABELS.name: 21_000}
STARTED_AT = 1_796_000_000.0  # a fixed clock reading: the same arguments, the same trace


def _key_for(campus: str) -> Callable[[str], SigningKey]:
    def key_for(name: str) -> SigningKey:
        return SigningKey.from_seed(hashlib.sha256(f"{campus}/{name}".encode()).digest())

    return key_for


@functools.cache
def demo_policy() -> str:
    """The demo campus's policy text, with signing keys derived from the nodes' names (the
    workers' sealing keys are made afresh once per process, as ``write_campus`` makes them)."""
    with tempfile.TemporaryDirectory(prefix="sg-twin-") as tmp:
        campus = write_campus(
            Path(tmp),
            _key_for("twin-demo"),
            mqtt_port=1,
            redis_url="redis://x",
            now=STARTED_AT,
            secure=False,
        )
        return campus.policy_file.read_text()


def _fingerprint(campus: str) -> str:
    return "sha256:" + hashlib.sha256(f"{campus} CA".encode()).hexdigest()


def write_sister(
    folder: Path,
    *,
    sent: Collection[str] = ("part-image", "ocr-crop"),
    max_jobs_per_s: float = 500.0,
    theirs_max_jobs_per_s: float | None = None,
    workers: int = 2,
    rtt_ms: float = 10.0,
    mb_per_s: float = 100.0,
) -> tuple[Path, Path]:
    """The demo campus's policy (v2) agreeing with sister campus ``south-site`` to send it
    ``sent`` at most ``max_jobs_per_s``, and a ``--peer`` file for south: its policy (its
    half says ``theirs_max_jobs_per_s``, by default the same), ``workers`` workers in its
    data centre lent, the link. Returns (our policy, the peer file)."""
    ours, theirs = _key_for("twin-demo"), _key_for(SOUTH)
    lent = {f"south-dc-{n}": (SOUTH_DC, "x86-cpu-dc") for n in range(1, workers + 1)}
    candidate = write_campus(
        folder / "north",
        ours,
        mqtt_port=1,
        redis_url="redis://x",
        now=STARTED_AT,
        secure=False,
        version=2,
        peers=peer_table(
            SOUTH, _fingerprint(SOUTH), theirs, sends=True, sent=sent, max_jobs_per_s=max_jobs_per_s
        ),
    )
    south = write_campus(
        folder / "south",
        theirs,
        mqtt_port=1,
        redis_url="redis://x",
        now=STARTED_AT,
        secure=False,
        workers=lent,
        campus=SOUTH,
        fab=FABS[SOUTH],
        peers=peer_table(
            "demo-campus",
            _fingerprint("demo-campus"),
            ours,
            sends=False,
            sent=sent,
            max_jobs_per_s=theirs_max_jobs_per_s or max_jobs_per_s,
        ),
    )
    models = ", ".join(f'"{m}"' for m in WORKER_MS)
    times = ", ".join(f'"{m}" = {ms}' for m, ms in WORKER_MS.items())
    tables = "".join(
        f'\n[[workers]]\nid = "{w}"\nzone = "{zone}"\ndevice_class = "{cls}"\n'
        f"models = [{models}]\ncapacity = 528\nmax_batch = 8\nconcurrency = 2\n"
        f"service_ms = {{ {times} }}\n"
        for w, (zone, cls) in lent.items()
    )
    peer = folder / "south-site.toml"
    peer.write_text(
        f'policy = "{south.policy_file.relative_to(folder)}"\n'
        f"rtt_ms = {rtt_ms!r}\nmb_per_s = {mb_per_s!r}\n{tables}"
    )
    return candidate.policy_file, peer


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


__all__ = ["KINDS", "demo_header", "demo_policy", "demo_trace", "write_sister"]
