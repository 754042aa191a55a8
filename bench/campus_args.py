"""The options every bench that drives the demo's campus traffic shares (``campus_burst``,
``frozen_worker``, ``twin_fidelity``): the rate per line, the burst on line 1, the line
PCs' share of a core and how often an image is a label; and that share as the campus takes
it (None: uncapped)."""

from __future__ import annotations

import argparse

from sluicegate.app.calibration import cpu_cap_available
from sluicegate.app.demo import EDGE_CPU
from sluicegate.app.traffic import LABEL_EVERY


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
