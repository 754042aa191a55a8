"""Flood benchmark: malformed job requests at an edge while real jobs run; does the edge keep
serving, and what does the flood cost it in memory and latency?

Processes: a Mosquitto (persistence on) and a Redis started for the run; one edge agent
(``line-1-pc`` of the local campus, uncapped, with ``--payload-limit`` as its
``max_payload_bytes``); this driver: a vision app sending ``--real-rate`` real jobs/s with
known ids (QoS 1), a raw-socket flooder and a listener for the refusals.

Phases: ``--before`` s of real jobs alone (the baseline), ``--seconds`` s of real jobs under a
flood of ``--rate`` malformed requests/s (the subject: the mixture of
``tests.faults.malformed.KINDS``: no response topic, garbage or empty payload, wrong or
mismatched content type, PNG/JPEG headers declaring 60,000 pixels a side, bad or past
deadlines, unknown or missing model, bad priority and data class, bad job id, 200 user
properties, payloads just under and just over the limit, a real header over a corrupt body,
user properties that are not UTF-8), then ``--after`` s of real jobs alone. The edge's RSS is
sampled at 10 Hz and its kernel peak mark reset when the flood starts.

    .venv/bin/python bench/flood.py                    # 1,000 msg/s for 10 s: ~30 s
    .venv/bin/python bench/flood.py --rate 2000 --seconds 20 --payload-limit 8388608
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from tests.faults.flooding import FloodReport, flood_while_serving  # noqa: E402
from tests.faults.malformed import KINDS  # noqa: E402
from tests.faults.rig import Rig  # noqa: E402

EDGE = "line-1-pc"
TARGET = {"real_lost": 0, "edge_peak_rss_growth_mib": 64.0}


def print_table(r: FloodReport, args: argparse.Namespace) -> None:
    v = r.verdict
    sent = sum(r.flood_sent.values())
    print(
        f"flood: {args.rate:g} malformed requests/s for {args.seconds:g} s at {EDGE} "
        f"(payload limit {args.payload_limit} B) while {args.real_rate:g} real jobs/s run; "
        f"nproc {os.cpu_count()}" + (f"; without {', '.join(args.exclude)}" if args.exclude else "")
    )
    print(
        f"  malformed sent        {sent} ({sent / args.seconds:.0f}/s achieved), "
        f"{r.flood_dropped_connections.get('bad', 0)} connections closed by Mosquitto "
        f"(invalid UTF-8), {r.flood_dropped_connections.get('main', 0)} others"
    )
    print(f"  refusals received     {sum(r.refusals.values())}  {dict(r.refusals.most_common())}")
    print(
        f"  real jobs             {v.submitted} submitted, {v.accepted} accepted, "
        f"{v.answered} completed, {len(v.lost)} lost, {len(v.duplicated)} duplicated, "
        f"statuses {dict(v.statuses)}, codes {dict(v.codes)}"
    )
    print(f"{'':24}{'jobs':>8}{'p50 ms':>10}{'p99 ms':>10}")
    for phase, label in (
        ("before", "before (baseline)"),
        ("flood", "during flood"),
        ("after", "after"),
    ):
        lat = r.latency_ms[phase]
        print(f"  {label:22}{r.real_by_phase.get(phase, 0):8}{lat['p50']:10.1f}{lat['p99']:10.1f}")
    rss = r.rss_mib
    print(
        f"  edge RSS MiB          before {rss['before']:.1f}, peak {rss['peak']:.1f} "
        f"(kernel mark since the flood {rss['hwm_since_flood']:.1f}), after {rss['after']:.1f}; "
        f"Mosquitto peak {r.mosquitto_rss_mib['peak']:.1f}"
    )
    print(f"  sent by kind          {dict(sorted(r.flood_sent.items()))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=float, default=1000.0, help="malformed requests/s")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long the flood lasts")
    ap.add_argument("--real-rate", type=float, default=20.0, help="real jobs/s throughout")
    ap.add_argument("--before", type=float, default=5.0, help="s of real jobs before the flood")
    ap.add_argument("--after", type=float, default=3.0, help="s of real jobs after the flood")
    ap.add_argument(
        "--payload-limit", type=int, default=1024 * 1024, help="the edge's max_payload_bytes"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--exclude",
        action="append",
        default=[],
        choices=[k.name for k in KINDS],
        help="leave this kind out of the flood (repeatable)",
    )
    args = ap.parse_args()
    kinds = [k for k in KINDS if k.name not in args.exclude]
    env = {"SLUICEGATE_EDGE__MAX_PAYLOAD_BYTES": str(args.payload_limit)}
    with (
        tempfile.TemporaryDirectory(prefix="sg-flood-") as tmp,
        Rig(Path(tmp), nodes=[EDGE], env=env, log_level="warning") as rig,
    ):
        report = asyncio.run(
            flood_while_serving(
                rig,
                edge=EDGE,
                flood_rate=args.rate,
                flood_s=args.seconds,
                real_rate=args.real_rate,
                before_s=args.before,
                after_s=args.after,
                payload_limit=args.payload_limit,
                seed=args.seed,
                kinds=kinds,
            )
        )
        alive = rig.campus.alive(EDGE)
    print_table(report, args)
    v = report.verdict
    growth = report.rss_mib["peak"] - report.rss_mib["before"]
    before, during = report.latency_ms["before"], report.latency_ms["flood"]
    result = {
        "bench": "flood",
        "subject": {
            "phase": "flood",
            "real_jobs": report.real_by_phase.get("flood", 0),
            "p50_ms": during["p50"],
            "p99_ms": during["p99"],
            "edge_peak_rss_mib": report.rss_mib["peak"],
            "malformed_sent": sum(report.flood_sent.values()),
            "refusals": sum(report.refusals.values()),
            "refusals_by_code": dict(report.refusals),
        },
        "baseline": {
            "phase": "before",
            "real_jobs": report.real_by_phase.get("before", 0),
            "p50_ms": before["p50"],
            "p99_ms": before["p99"],
            "edge_rss_mib": report.rss_mib["before"],
        },
        "ratio": {
            "p50": stats.ratio(during["p50"], before["p50"]),
            "p99": stats.ratio(during["p99"], before["p99"]),
            "rss_peak_over_before": stats.ratio(report.rss_mib["peak"], report.rss_mib["before"]),
        },
        "real": {
            "submitted": v.submitted,
            "completed": v.answered,
            "lost": len(v.lost),
            "duplicated": len(v.duplicated),
            "statuses": dict(v.statuses),
            "codes": dict(v.codes),
            "after_flood": report.real_by_phase.get("after", 0),
        },
        "target": TARGET,
        "met": alive
        and not v.lost
        and v.answered == v.submitted
        and growth <= TARGET["edge_peak_rss_growth_mib"],
        "measured": stats.require(
            {
                "malformed requests sent": sum(report.flood_sent.values()),
                "refusals received": sum(report.refusals.values()),
                "real jobs before the flood": report.real_by_phase.get("before", 0),
                "real jobs during the flood": report.real_by_phase.get("flood", 0),
                "real jobs completed": v.answered,
            }
        ),
        "params": vars(args),
        "machine": stats.machine(),
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
