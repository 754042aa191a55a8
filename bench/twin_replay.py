"""Benchmark: how fast the twin replays a campus, and the placement strategies on one trace.

A ``--minutes`` trace of the demo campus's two lines (``sluicegate.app.twin_demo``: 10
images/s per line, line 1 at 10x for 10 s every minute, one image in 16 a label), replayed
through the production decision code (``sluicegate.twin.sim``) as recorded, ``--rounds``
times after one warm-up: wall time per replay against the trace's own length (target: a
10-minute trace in under 10 s on 2 cores). Then the same trace under each placement
strategy (ours, edge-only, round-robin, least-loaded) side by side, then with twice the
arrivals and the on-campus worker lost half-way, and with twice the arrivals and the
off-site worker ten times slower (where the strategies part).

    .venv/bin/python bench/twin_replay.py                 # about 30 s on 2 cores
    .venv/bin/python bench/twin_replay.py --minutes 2 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import stats
from sluicegate.app.twin_demo import demo_trace
from sluicegate.twin.nodes import STRATEGIES, Change, Result
from sluicegate.twin.report import strategy_table, summarise
from sluicegate.twin.sim import replay

TARGET_S = 10.0  # for a 10-minute trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the trace")
    ap.add_argument("--rounds", type=int, default=3, help="timed replays after a warm-up")
    args = ap.parse_args()
    seconds = args.minutes * 60.0
    bursts = tuple((float(m * 60 + 20), 10.0) for m in range(int(args.minutes)))
    trace = demo_trace(seconds, bursts=bursts)
    replay(trace)  # warm-up: imports, caches
    walls = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        result = replay(trace)
        walls.append(time.perf_counter() - t)
    wall = stats.median(walls)
    jobs = len(trace.jobs)
    target = TARGET_S * args.minutes / 10.0
    print(
        f"twin replay: {args.minutes:g}-minute two-line trace, {jobs} jobs, "
        f"{len(bursts)} bursts; nproc {os.cpu_count()}"
    )
    print(
        f"  replay wall time p50 {wall:.2f} s over {args.rounds} rounds "
        f"({', '.join(f'{w:.2f}' for w in walls)}); {seconds / wall:.0f}x real time, "
        f"{jobs / wall:,.0f} jobs/s; target {target:.1f} s"
    )
    plain: dict[str, Result] = {s: replay(trace, Change(strategy=s)) for s in STRATEGIES}
    print("\nstrategies, the trace as recorded:")
    print(strategy_table(plain))
    hard: dict[str, Result] = {
        s: replay(trace, Change(strategy=s, burst=2, fail=(("north-cpu-1", seconds / 2),)))
        for s in STRATEGIES
    }
    print("\nstrategies, 2x the arrivals and north-cpu-1 lost half-way:")
    print(strategy_table(hard))
    slow: dict[str, Result] = {
        s: replay(trace, Change(strategy=s, burst=2, degrade=(("cloud-cpu-1", 10.0),)))
        for s in STRATEGIES
    }
    print("\nstrategies, 2x the arrivals and cloud-cpu-1 ten times slower:")
    print(strategy_table(slow))
    out = {
        "bench": "twin_replay",
        "subject": {"wall_s": wall, "walls": walls, "jobs": jobs, "speedup": seconds / wall},
        "baseline": {"trace_s": seconds},
        "ratio": {"real_time_over_wall": seconds / wall},
        "strategies": {
            name: {s: summarise(r).attainment for s, r in runs.items()}
            for name, runs in (
                ("recorded", plain),
                ("burst2_lose_north", hard),
                ("burst2_slow_cloud", slow),
            )
        },
        "target": {"wall_s": target},
        "met": wall <= target and summarise(result).jobs == jobs,
        "measured": stats.require(
            {
                "trace jobs": jobs,
                "timed replays": len(walls),
                "jobs replayed": summarise(result).jobs,
            }
        ),
        "machine": stats.machine(),
    }
    print(stats.result_line(out))


if __name__ == "__main__":
    main()
