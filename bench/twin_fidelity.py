"""Benchmark: does the twin predict the campus it recorded?

Each round runs the demo's campus as ``bench/campus_burst.py`` does (broker, two edges
capped to ``--edge-cpu`` of a core, an on-campus and an off-site worker, secured, timed
before they serve) and drives its traffic (``--rate`` images/s per line, line 1 at 10x for
``--burst`` s in volleys of 20, one image in 16 a label) while ``sluicegate twin record``
listens as the campus's observer. Then it replays the trace with no change
(``sluicegate.twin.sim``) and prints predicted against observed, the observed figures as
the vision apps saw them: deadline attainment (bound: within 2 points), the share of jobs
offloaded (5 points) and p99 latency (25 %). It also prints the live system's own
prediction error from the trace: each local job's predicted completion at admission
against when it finished (the edges'), and each offloaded job's completion on its worker
as the broker predicted it when it placed the job against when the worker finished it.
And the apps' own legs, which no trace holds (their publish reaching the edge, the result
reaching them: a job's latency at its app less its latency at its edge), with the jobs in
time at their edge that were late at their app.

    .venv/bin/python bench/twin_fidelity.py                # about 90 s on 2 cores
    .venv/bin/python bench/twin_fidelity.py --rounds 1 --label-every 0
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import campus_args, stats
from sluicegate import wire
from sluicegate.app.campus import OBSERVER
from sluicegate.app.servers import running, start_redis
from sluicegate.app.traffic import Sample, Tally, stream
from sluicegate.twin import trace as tr
from sluicegate.twin.record import record
from sluicegate.twin.report import summarise
from sluicegate.twin.sim import replay

nan = float("nan")
BOUNDS = {"attainment_points": 2.0, "offload_points": 5.0, "p99_relative": 0.25}


class _Seen(Tally):
    """The apps' tally, keeping each result's latency as its app saw it and whether that
    was in time, by job id (to set beside the trace's)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_job: dict[str, tuple[float, bool]] = {}

    def record(self, line: str, sample: Sample, result: wire.JobResult, ms: float) -> None:
        super().record(line, sample, result, ms)
        in_time = result.status == "ok" and ms <= sample.kind.deadline_ms
        self.by_job[result.job_id] = (ms, in_time)


async def _drive(campus: Any, out: Path, args: argparse.Namespace) -> tuple[_Seen, tr.Trace]:
    stop, ready = asyncio.Event(), asyncio.Event()
    recording = asyncio.ensure_future(record(campus.mqtt(OBSERVER), out, stop, ready=ready))
    await asyncio.wait_for(ready.wait(), 20.0)
    tally = _Seen()
    await stream(
        campus,
        args.rate,
        args.burst + 4.0,
        asyncio.Event(),
        tally,
        burst_at=2.0,
        burst_for=args.burst,
        label_every=args.label_every,
    )
    stop.set()
    recorded = await recording
    return tally, recorded.trace


def one_round(redis_port: int, db: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sg-fidelity-") as tmp:
        root = Path(tmp)
        redis_url = f"redis://127.0.0.1:{redis_port}/{db}"
        with campus_args.started_campus(root / "campus", redis_url, args) as campus:
            out = root / "trace.jsonl.gz"
            tally, trace = asyncio.run(_drive(campus.campus, out, args))
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(out, args.keep / f"round-{db + 1}.jsonl.gz")
    lat = list(tally.latencies_ms)
    observed = {
        "jobs": tally.answered,
        "attainment": tally.in_time / max(tally.answered, 1),
        "offload_ratio": tally.kinds.get("pool", 0) / max(tally.answered, 1),
        "p99_ms": stats.percentile(lat, 99),
    }
    recorded_in_time = sum(
        j.status == "ok" and (j.deadline_ms is None or j.latency_ms <= j.deadline_ms)
        for j in trace.jobs
    )
    observed["recorded_attainment"] = recorded_in_time / max(len(trace.jobs), 1)
    edge_lat = [j.latency_ms for j in trace.jobs if j.status == "ok"]
    observed["recorded_p99_ms"] = stats.percentile(edge_lat, 99)
    # The apps' own legs, which no trace holds: their publish reaching the edge and the
    # result reaching them (a job's latency at its app less its latency at its edge).
    legs, inbound, outbound, late_at_app = [], [], [], 0
    for j in trace.jobs:
        seen = tally.by_job.get(j.job_id)
        if seen is None:
            continue
        legs.append(seen[0] - j.latency_ms)
        if j.inbound_ms is not None:  # the app's send to the edge, from its sent-at stamp
            inbound.append(j.inbound_ms)
            outbound.append(seen[0] - j.latency_ms - j.inbound_ms)
        in_time_here = j.status == "ok" and (j.deadline_ms is None or j.latency_ms <= j.deadline_ms)
        late_at_app += in_time_here and not seen[1]
    observed["apps_legs_p50_ms"] = stats.percentile(legs, 50) if legs else nan
    observed["apps_legs_p90_ms"] = stats.percentile(legs, 90) if legs else nan
    observed["inbound_p50_ms"] = stats.percentile(inbound, 50) if inbound else nan
    observed["inbound_p90_ms"] = stats.percentile(inbound, 90) if inbound else nan
    observed["outbound_p50_ms"] = stats.percentile(outbound, 50) if outbound else nan
    observed["outbound_p90_ms"] = stats.percentile(outbound, 90) if outbound else nan
    observed["late_at_app_only"] = late_at_app
    observed["joined"] = len(legs)
    s = summarise(replay(trace))
    predicted = {
        "jobs": s.jobs,
        "attainment": s.attainment,
        "offload_ratio": s.offload_ratio,
        "p99_ms": s.p99_ms,
    }
    local = [
        (j.latency_ms, j.predicted_ms)
        for j in trace.jobs
        if j.status == "ok" and not j.offloaded and j.predicted_ms is not None
    ]
    pool = [
        (j.worker_done_ms, j.pool_predicted_ms)
        for j in trace.jobs
        if j.worker_done_ms is not None and j.pool_predicted_ms is not None
    ]
    return {
        "trace_jobs": len(trace.jobs),
        "observed": observed,
        "predicted": predicted,
        "edge_prediction": _errors(local),
        "pool_prediction": _errors(pool),
    }


def _errors(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """Actual against predicted completion, ms after arrival: |error| p50, p90, mean signed."""
    if not pairs:
        return {"n": 0, "p50_abs_ms": nan, "p90_abs_ms": nan, "bias_ms": nan}
    errors = [a - p for a, p in pairs]
    return {
        "n": len(pairs),
        "p50_abs_ms": stats.percentile(map(abs, errors), 50),
        "p90_abs_ms": stats.percentile(map(abs, errors), 90),
        "bias_ms": sum(errors) / len(errors),
    }


def within(r: dict[str, Any]) -> dict[str, bool]:
    o, p = r["observed"], r["predicted"]
    return {
        "attainment": abs(o["attainment"] - p["attainment"]) * 100 <= BOUNDS["attainment_points"],
        "offload_ratio": abs(o["offload_ratio"] - p["offload_ratio"]) * 100
        <= BOUNDS["offload_points"],
        "p99": abs(p["p99_ms"] - o["p99_ms"]) <= BOUNDS["p99_relative"] * o["p99_ms"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    campus_args.add_traffic(ap, burst=10.0)
    ap.add_argument("--keep", type=Path, default=None, help="copy each round's trace here")
    args = ap.parse_args()
    args.edge_cpu = campus_args.edge_share(args)
    rounds = []
    with running(start_redis()) as redis:
        for r in range(args.rounds):
            rounds.append(one_round(redis.port, r, args))
    print(
        f"twin fidelity: {args.rate:g}/s per line, {args.burst:g} s burst on line 1, one image "
        f"in {args.label_every or 'none'} a label, edges at {args.edge_cpu or 1:.0%} of a "
        f"core; {args.rounds} rounds, nproc {os.cpu_count()}"
    )
    print(f"{'':10}{'':14}{'observed':>10}{'at edges':>10}{'predicted':>11}{'bound':>8}  within")
    for i, one in enumerate(rounds):
        o, p, ok = one["observed"], one["predicted"], within(one)
        print(f"round {i + 1:<4}{'jobs':14}{o['jobs']:10d}{one['trace_jobs']:10d}{p['jobs']:11d}")
        rows = (
            ("attainment", "attainment", "recorded_attainment", "±2 pt", "attainment", ".3f"),
            ("offloaded", "offload_ratio", "offload_ratio", "±5 pt", "offload_ratio", ".3f"),
            ("p99 ms", "p99_ms", "recorded_p99_ms", "±25 %", "p99", ".1f"),
        )
        for name, key, edge_key, bound, check, fmt in rows:
            print(
                f"{'':10}{name:14}{o[key]:10{fmt}}{o.get(edge_key, o[key]):10{fmt}}"
                f"{p[key]:11{fmt}}{bound:>8}  {ok[check]}"
            )
        print(
            f"{'':10}the apps' own legs: p50 {o['apps_legs_p50_ms']:.1f} p90 "
            f"{o['apps_legs_p90_ms']:.1f} ms (to the edge p50 {o['inbound_p50_ms']:.1f} p90 "
            f"{o['inbound_p90_ms']:.1f}, back p50 {o['outbound_p50_ms']:.1f} p90 "
            f"{o['outbound_p90_ms']:.1f}); {o['late_at_app_only']} jobs in time at their edge "
            "were late at their app"
        )
        for who, key, jobs in (
            ("edges'", "edge_prediction", "jobs run there"),
            ("broker's", "pool_prediction", "offloaded jobs, to the worker's end"),
        ):
            e = one[key]
            print(
                f"{'':10}{who} prediction error: p50 {e['p50_abs_ms']:.1f} p90 "
                f"{e['p90_abs_ms']:.1f} bias {e['bias_ms']:+.1f} ms over {e['n']} {jobs}"
            )
    result = {
        "bench": "twin_fidelity",
        "subject": {"predicted": [r["predicted"] for r in rounds]},
        "baseline": {"observed": [r["observed"] for r in rounds]},
        "ratio": {"within": [within(r) for r in rounds]},
        "edge_prediction": [r["edge_prediction"] for r in rounds],
        "pool_prediction": [r["pool_prediction"] for r in rounds],
        "target": BOUNDS,
        "met": all(all(within(r).values()) for r in rounds),
        "measured": stats.require(
            {
                "jobs answered": sum(r["observed"]["jobs"] for r in rounds),
                "jobs recorded": sum(r["trace_jobs"] for r in rounds),
                "jobs replayed": sum(r["predicted"]["jobs"] for r in rounds),
                "jobs joined with their app's result": sum(r["observed"]["joined"] for r in rounds),
            }
        ),
        "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": stats.machine(),
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
