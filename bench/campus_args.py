"""What the benches that drive the demo's campus traffic share (``campus_burst``,
``frozen_worker``, ``twin_fidelity``, ``announced_burst``): the options (the rate per line,
the burst on line 1, the line PCs' share of a core and how often an image is a label; and
that share as the campus takes it, None: uncapped), a fresh campus timed and started for
one run (:func:`started_campus`), and the apps' tally with each answer's moment
(:class:`Timed`)."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample as MetricSample

from sluicegate import wire
from sluicegate.app.broker_http import get
from sluicegate.app.calibration import cpu_cap_available
from sluicegate.app.demo import EDGE_CPU
from sluicegate.app.localcampus import LocalCampus, start_campus_mosquitto
from sluicegate.app.servers import free_port, running
from sluicegate.app.traffic import LABEL_EVERY, Sample, Tally


def add_traffic(ap: argparse.ArgumentParser, *, burst: float) -> None:
    ap.add_argument("--rate", type=float, default=10.0, help="images/s per line outside bursts")
    ap.add_argument("--burst", type=float, default=burst, help="seconds of 10x burst on line 1")
    ap.add_argument(
        "--edge-cpu",
        type=float,
        default=EDGE_CPU,
        help="cap each edge to this share of one core (a modest line PC, as in the demo); "
        "0: no cap",
    )
    ap.add_argument(
        "--label-every",
        type=int,
        default=LABEL_EVERY,
        help="one image in this many is a label crop for OCR (0: surface images only)",
    )


def edge_share(args: argparse.Namespace) -> float | None:
    """``--edge-cpu`` as the campus takes it: None when uncapped (0 given, or no writable
    CPU cgroup here, which is said)."""
    if args.edge_cpu and cpu_cap_available():
        return float(args.edge_cpu)
    print("note: edges run uncapped (no writable CPU cgroup, or --edge-cpu 0)")
    return None


def metric_samples(url: str) -> list[MetricSample]:
    """Every sample a node's or the broker's ``/metrics`` at ``url`` holds now."""
    status, body = get(url, None, timeout=5)
    if status != 200:
        raise SystemExit(f"{url} answered {status}")
    return [s for family in text_string_to_metric_families(body.decode()) for s in family.samples]


@contextlib.contextmanager
def started_campus(
    root: Path,
    redis_url: str,
    args: argparse.Namespace,
    env: Mapping[str, str] | None = None,
    standby: Collection[str] = (),
    worker_cpu: float | None = None,
) -> Iterator[LocalCampus]:
    """A fresh secured campus in ``root`` on ``redis_url``: written, its models timed on
    each kind of node (the line PCs under ``args.edge_cpu``, the workers under
    ``worker_cpu``), its Mosquitto and every node but the ``standby`` workers started;
    stopped on the way out."""
    campus = LocalCampus(
        root,
        mqtt_port=free_port(),
        redis_url=redis_url,
        env=dict(env or {}),
        edge_cpu=args.edge_cpu,
        worker_cpu=worker_cpu,
        standby=standby,
    )
    files = campus.write()
    campus.calibrate()
    with running(start_campus_mosquitto(files)):
        campus.start()
        try:
            yield campus
        finally:
            campus.stop()


class Answered(NamedTuple):
    """One answer as its app saw it: when the job was submitted (``time.monotonic``), its
    kind, the node that ran it (its status when none did), and whether it was in time."""

    at: float
    kind: str
    node: str
    in_time: bool


@dataclass
class Timed(Tally):
    """The apps' tally, and every answer with its submission moment."""

    answers: list[Answered] = field(default_factory=list)

    def record(self, line: str, sample: Sample, result: wire.JobResult, ms: float) -> None:
        super().record(line, sample, result, ms)
        in_time = result.status == "ok" and ms <= sample.kind.deadline_ms
        at = time.monotonic() - ms / 1000.0
        self.answers.append(
            Answered(at, sample.kind.name, result.ran_on.node or result.status, in_time)
        )
