"""Chaos benchmark: jobs through a whole local campus while random SIGKILLs hit its edges,
broker and workers; a Jepsen-style table of what the vision app saw.

Processes: a Mosquitto (persistence on) and a Redis (append-only file, fsync every second)
started for the run; the local campus (``sluicegate.app.localcampus``: a broker, two edge
agents capped to ``--edge-cpu`` of a core so bursts offload, an on-campus and an off-site
worker); this driver: an at-least-once vision app (``tests.faults.app.App``: QoS 1, known
job ids, persistent session, raw deliveries counted per job id) and an observer of the
campus's own topics.

The app submits ``--jobs`` jobs at ``--rate`` per second in volleys, alternating the two
lines, two thirds wafer images (campus only) and one third OCR crops (may go off-site), no
deadline. A job with no result after ``--resubmit-after`` s is published again under the
same job id, as a real at-least-once client would (and a publish that was not PUBACKed is
retried). Meanwhile ``--kills`` SIGKILLs, at random times over the submission window, hit a
random edge, the broker or a random worker; each victim is restarted ``--restart-delay`` s
later on the same ports and state. A baseline run without kills (``--baseline-jobs``) goes
first on the same servers.

Figures: accepted (PUBACKed) jobs; lost (accepted, no result by the end: must be 0);
duplicated (a job with more than one *distinct* result: must be 0); raw duplicate
deliveries (the same result again, removed by job id); rescued (first result only after
the app resubmitted: the campus had dropped or stalled it); duplicate executions (a job run
more than once: pool completions seen on the broker topic, plus the delivered local run; a
local run cut short by a crash leaves no trace and is not counted); unexpected results (for
ids never submitted); recovery time from each kill to the first result of the restarted
component (edge: a result for one of its jobs; worker: a completion; broker: a placement
reply); peak RSS of each component.

    .venv/bin/python bench/chaos.py                           # 10,000 jobs, 20 kills: ~3 min
    .venv/bin/python bench/chaos.py --jobs 1000 --kills 5     # quick: under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import meter_check, stats  # noqa: E402
from sluicegate.app.campus import BROKER, LINES, WORKERS  # noqa: E402
from sluicegate.app.localcampus import ROLE  # noqa: E402
from tests.faults.app import App, Observer, Timeline  # noqa: E402
from tests.faults.ledger import JobRecord, Ledger, Verdict  # noqa: E402
from tests.faults.rig import WIRETAP, Rig, RssSampler, image_for  # noqa: E402

EDGES = list(LINES)
TARGETS = [*EDGES, BROKER, *WORKERS]
TARGET = {
    "lost": 0,
    "duplicated": 0,
    "unexpected": 0,
    "billed_twice": 0,
    "billed_over_results_within": 0.01,
}


@dataclass
class Kill:
    at: float  # seconds from the start of the run
    target: str
    killed: float = 0.0  # time.monotonic()
    back: float | None = None  # online again
    recovered: float | None = None  # its first result after the restart
    by_flow: bool = False  # none of its own: recovered when the app's results flowed again

    def recovery_s(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.killed

    def downtime_s(self) -> float | None:
        return None if self.back is None else self.back - self.killed


@dataclass
class Run:
    name: str
    verdict: Verdict
    kills: list[Kill]
    seconds: float
    submit_seconds: float
    latency_ms: dict[str, float]
    rescued: int
    executions: Counter[int]  # executions per job -> jobs
    peak_rss_mib: dict[str, float]
    ack_failures: dict[str, int] = field(default_factory=dict)
    metering: dict[str, object] = field(default_factory=dict)  # bench/meter_check.py's figures

    @property
    def duplicate_executions(self) -> int:
        return sum((n - 1) * jobs for n, jobs in self.executions.items() if n > 1)


def executions(ledger: Ledger, timeline: Timeline) -> Counter[int]:
    """Per accepted job, how many times it was seen to run (see the module doc)."""
    runs: Counter[int] = Counter()
    for job in ledger.jobs.values():
        if not job.deliveries:
            continue
        pool = {
            (worker, attempt)
            for worker, attempt, status in timeline.completions.get(job.job_id, [])
            if status in ("ok", "failed")
        }
        final = job.deliveries[0][1]
        local = (
            1
            if (final.get("ran_on") or {}).get("kind") == "edge"
            and final.get("status") in ("ok", "failed")
            else 0
        )
        runs[len(pool) + local] += 1
    return runs


async def _load(app: App, args: argparse.Namespace, n_jobs: int, prefix: str) -> None:
    tasks: set[asyncio.Task[bool]] = set()
    start = time.monotonic()
    n = 0
    while n < n_jobs:
        edge = EDGES[(n // args.volley) % len(EDGES)]
        for _ in range(min(args.volley, n_jobs - n)):
            job_id = f"{prefix}-{n}"
            data_class = "ocr-crop" if n % 3 == 0 else "wafer-image"
            task = asyncio.ensure_future(
                app.submit(edge, job_id, image_for(job_id), data_class=data_class)
            )
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
        await asyncio.sleep(max(0.0, start + n / args.rate - time.monotonic()))  # the pace
    if tasks:
        await asyncio.wait(tasks)


async def _resubmitter(app: App, after_s: float, stop: asyncio.Event) -> None:
    tasks: set[asyncio.Task[bool]] = set()
    while not stop.is_set():
        now = time.monotonic()
        for job in app.ledger.unanswered():
            if now - job.last_published_at >= after_s:
                task = asyncio.ensure_future(app.resubmit(job.job_id))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def _chaos(rig: Rig, kills: list[Kill], delay_s: float, t0: float) -> None:
    for kill in kills:
        await asyncio.sleep(max(0.0, t0 + kill.at - time.monotonic()))  # the schedule
        kill.killed = time.monotonic()
        await asyncio.to_thread(rig.campus.kill, kill.target)
        await asyncio.sleep(delay_s)  # the victim stays down this long
        await asyncio.to_thread(rig.campus.restart, kill.target)
        kill.back = time.monotonic()


def _recoveries(kills: list[Kill], ledger: Ledger, timeline: Timeline) -> None:
    """When each victim produced its first result after its restart; where it produced none
    (e.g. the off-site worker, which gets work only when the campus one is full), when
    results reached the app again."""
    results_by_edge: dict[str, list[float]] = {edge: [] for edge in EDGES}
    for job in ledger.jobs.values():
        for at, _doc in job.deliveries:
            results_by_edge.setdefault(job.edge, []).append(at)
    every = sorted(t for times in results_by_edge.values() for t in times)
    for times in results_by_edge.values():
        times.sort()
    for kill in kills:
        if kill.back is None:
            continue
        if kill.target in EDGES:
            later = [t for t in results_by_edge[kill.target] if t >= kill.back]
            kill.recovered = later[0] if later else None
        else:
            kind = "reply" if kill.target == BROKER else "completion"
            node = None if kill.target == BROKER else kill.target
            event = timeline.first(kind, node, kill.back)
            kill.recovered = event.at if event is not None else None
        if kill.recovered is None:
            later = [t for t in every if t >= kill.back]
            kill.recovered = later[0] if later else None
            kill.by_flow = True


async def one_run(rig: Rig, args: argparse.Namespace, name: str, n_jobs: int, n_kills: int) -> Run:
    rng = random.Random(f"{args.seed}-{name}")
    window = n_jobs / args.rate
    # Kills land between 5 % and 80 % of the submission window, in time order, so load
    # still runs after each restart.
    kills = sorted(
        (Kill(rng.uniform(0.05, 0.8) * window, rng.choice(TARGETS)) for _ in range(n_kills)),
        key=lambda k: k.at,
    )
    app = await App(rig.mqtt()).start()
    observer = await Observer(rig.mqtt(WIRETAP)).start(work=False)
    stop = asyncio.Event()
    t0 = time.monotonic()
    try:
        resubmitter = asyncio.ensure_future(_resubmitter(app, args.resubmit_after, stop))
        chaos = asyncio.ensure_future(_chaos(rig, kills, args.restart_delay, t0))
        await _load(app, args, n_jobs, name)
        submit_seconds = time.monotonic() - t0
        await chaos
        # Everything published is owed a result; wait (bounded), resubmitting as we go.
        deadline = time.monotonic() + args.settle
        while app.ledger.unanswered() and time.monotonic() < deadline:
            await app.wait_results(min(1.0, deadline - time.monotonic()))
        stop.set()
        await resubmitter
        seconds = time.monotonic() - t0
    finally:
        stop.set()
        await observer.close()
        await app.close()
    _recoveries(kills, app.ledger, observer.timeline)
    verdict = app.ledger.verdict()
    metering = meter_check.check(
        broker_url=f"http://127.0.0.1:{rig.campus.http_port}",
        token=rig.files.console_token("viewer"),
        policy_file=rig.files.policy_file,
        jobs=app.ledger.jobs,
        prefix=name,
    )
    latencies = [
        (j.first_result_at - j.published_at) * 1000.0
        for j in app.ledger.jobs.values()
        if j.first_result_at is not None
    ]
    return Run(
        name=name,
        verdict=verdict,
        kills=kills,
        seconds=seconds,
        submit_seconds=submit_seconds,
        latency_ms={"p50": stats.percentile(latencies, 50), "p99": stats.percentile(latencies, 99)},
        rescued=sum(1 for j in app.ledger.jobs.values() if _rescued(j)),
        executions=executions(app.ledger, observer.timeline),
        peak_rss_mib={},
        ack_failures=dict(app.ack_failures),
        metering=metering,
    )


def _rescued(job: JobRecord) -> bool:
    """The first result came only after the app had published the job again."""
    first = job.first_result_at
    return first is not None and job.resubmits > 0 and job.last_published_at <= first


def summary(run: Run) -> dict[str, object]:
    rec = [k.recovery_s() for k in run.kills]
    down = [k.downtime_s() for k in run.kills]
    recovered = [r for r in rec if r is not None]
    v = run.verdict
    return {
        "accepted": v.accepted,
        "submitted": v.submitted,
        "lost": len(v.lost),
        "duplicated": len(v.duplicated),
        "raw_duplicates": v.raw_duplicates,
        "duplicate_executions": run.duplicate_executions,
        "unexpected": v.unexpected,
        "rescued_by_resubmit": run.rescued,
        "resubmits": v.resubmits,
        "kills": len(run.kills),
        "kills_by_target": dict(Counter(k.target for k in run.kills)),
        "not_recovered": len(rec) - len(recovered),
        "recovery_by_flow": sum(1 for k in run.kills if k.by_flow and k.recovered is not None),
        "recovery_p50_s": stats.percentile(recovered, 50),
        "recovery_p99_s": stats.percentile(recovered, 99),
        "downtime_p50_s": stats.percentile([d for d in down if d is not None], 50),
        "recovery_p50_s_by_role": {
            role: stats.percentile(
                [
                    r
                    for k, r in zip(run.kills, rec, strict=True)
                    if r is not None and ROLE[k.target] == role
                ],
                50,
            )
            for role in ("edge", "broker", "pool")
            if any(ROLE[k.target] == role for k in run.kills)
        },
        "latency_p50_ms": run.latency_ms["p50"],
        "latency_p99_ms": run.latency_ms["p99"],
        "throughput_jobs_s": v.accepted / run.seconds if run.seconds else float("nan"),
        "seconds": run.seconds,
        "statuses": dict(v.statuses),
        "codes": dict(v.codes),
        "ran_on": dict(v.ran_on),
        "executions_per_job": {str(k): n for k, n in sorted(run.executions.items())},
        "peak_rss_mib": {k: round(x, 1) for k, x in sorted(run.peak_rss_mib.items())},
        "publish_not_acked": run.ack_failures,
        "metering": run.metering,
    }


def print_tables(runs: list[Run], args: argparse.Namespace) -> None:
    print(
        f"chaos: {args.jobs} jobs at {args.rate:g}/s in volleys of {args.volley}, "
        f"{args.kills} SIGKILLs (restart after {args.restart_delay:g} s), seed {args.seed}, "
        f"edges capped at {args.edge_cpu or 1:.0%} of a core, resubmit after "
        f"{args.resubmit_after:g} s, nproc {os.cpu_count()}"
    )
    rows = [
        ("accepted", "accepted", "{}"),
        ("lost (must be 0)", "lost", "{}"),
        ("duplicated results (must be 0)", "duplicated", "{}"),
        ("raw duplicate deliveries", "raw_duplicates", "{}"),
        ("duplicate executions", "duplicate_executions", "{}"),
        ("unexpected results", "unexpected", "{}"),
        ("rescued by a resubmission", "rescued_by_resubmit", "{}"),
        ("kills", "kills", "{}"),
        ("recovery p50 (s)", "recovery_p50_s", "{:.2f}"),
        ("recovery p99 (s)", "recovery_p99_s", "{:.2f}"),
        ("  of which: by results flowing again", "recovery_by_flow", "{}"),
        ("kills without recovery seen", "not_recovered", "{}"),
        ("latency p50 (ms)", "latency_p50_ms", "{:.1f}"),
        ("latency p99 (ms)", "latency_p99_ms", "{:.1f}"),
        ("throughput (jobs/s)", "throughput_jobs_s", "{:.1f}"),
    ]
    sums = [summary(r) for r in runs]
    print(f"{'':34}" + "".join(f"{r.name:>14}" for r in runs))
    for label, key, fmt in rows:
        print(f"{label:34}" + "".join(f"{fmt.format(s[key]):>14}" for s in sums))
    for run, s in zip(runs, sums, strict=True):
        print(f"[{run.name}] statuses {s['statuses']} codes {s['codes']} ran on {s['ran_on']}")
        print(f"[{run.name}] executions per job {s['executions_per_job']}")
        print(f"[{run.name}] peak RSS MiB {s['peak_rss_mib']}")
        by_role = s["recovery_p50_s_by_role"]
        if isinstance(by_role, dict) and by_role:
            shown = ", ".join(f"{role} {x:.2f} s" for role, x in by_role.items())
            print(f"[{run.name}] recovery p50 by role: {shown}")
        for k in run.kills:
            rec, down = k.recovery_s(), k.downtime_s()
            print(
                f"  kill at {k.at:6.1f} s  {k.target:12} down "
                f"{'-' if down is None else f'{down:.2f} s':>8}  recovered "
                f"{'-' if rec is None else f'{rec:.2f} s':>8}"
                + ("  (results flowing again)" if k.by_flow else "")
            )
        for job_id in run.verdict.lost[:10]:
            print(f"  LOST {job_id}")
    print("usage records (bench/meter_check.py): billed once per job that ran, waste apart")
    meter_rows = [
        ("records in the export", "records", "{}"),
        ("meter verify passes", "verified", "{}"),
        ("jobs that ran (results)", "jobs_ran", "{}"),
        ("jobs billed", "jobs_billed", "{}"),
        ("billed twice (must be 0)", "jobs_billed_twice", "{}"),
        ("ran, not billed (must be 0)", "ran_not_billed", "{}"),
        ("billed, not delivered (must be 0)", "billed_not_delivered", "{}"),
        ("billed on another node (must be 0)", "billed_on_other_node", "{}"),
        ("waste attempts", "waste_attempts", "{}"),
        ("waste device-seconds", "waste_device_s", "{:.3f}"),
        ("unsettled jobs", "unsettled_jobs", "{}"),
        ("billed device-seconds", "billed_device_s", "{:.3f}"),
        ("results' device-seconds", "results_device_s", "{:.3f}"),
        ("billed / results", "billed_over_results", "{:.4f}"),
    ]
    for label, key, fmt in meter_rows:
        print(f"{label:34}" + "".join(f"{fmt.format(r.metering.get(key)):>14}" for r in runs))
    for run in runs:
        problems = run.metering.get("problems") or []
        assert isinstance(problems, list)
        for problem in problems:
            print(f"  [{run.name}] {problem}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=int, default=10_000, help="jobs in the chaos run")
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs in the chaos run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=100.0, help="jobs/s submitted (both lines)")
    ap.add_argument("--volley", type=int, default=10, help="jobs per volley at one line")
    ap.add_argument("--restart-delay", type=float, default=0.5, help="s a victim stays down")
    ap.add_argument("--resubmit-after", type=float, default=20.0, help="s without a result")
    ap.add_argument("--settle", type=float, default=90.0, help="s to wait for the last results")
    ap.add_argument("--edge-cpu", type=float, default=0.1, help="share of a core per edge; 0: none")
    ap.add_argument(
        "--baseline-jobs", type=int, default=None, help="jobs in the run without kills (jobs/5)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the run's directory and logs")
    args = ap.parse_args()
    baseline_jobs = args.baseline_jobs if args.baseline_jobs is not None else args.jobs // 5
    root = Path(tempfile.mkdtemp(prefix="sg-chaos-"))
    runs: list[Run] = []
    with Rig(root, edge_cpu=args.edge_cpu or None, log_level="warning") as rig:
        campus = rig.campus

        def pids() -> dict[str, int | None]:
            return {name: campus.pid(name) for name in [*campus.nodes, "mosquitto", "redis"]}

        for name, n_jobs, n_kills in (
            ("baseline", baseline_jobs, 0),
            ("chaos", args.jobs, args.kills),
        ):
            if n_jobs <= 0:
                continue
            with RssSampler(pids) as rss:
                run = asyncio.run(one_run(rig, args, name, n_jobs, n_kills))
            run.peak_rss_mib = dict(rss.peak_mib)
            runs.append(run)
    print_tables(runs, args)
    chaos = next((r for r in runs if r.name == "chaos"), runs[-1])
    base = next((r for r in runs if r.name == "baseline"), None)
    subject = summary(chaos)
    baseline = summary(base) if base is not None else {}
    met = subject["lost"] == 0 and subject["duplicated"] == 0 and subject["unexpected"] == 0
    m = chaos.metering
    metering_met = (
        m.get("verified") is True
        and m.get("jobs_billed_twice") == 0
        and m.get("ran_not_billed") == 0
        and m.get("billed_not_delivered") == 0
        and m.get("billed_on_other_node") == 0
        and abs(float(m.get("billed_over_results", 0.0)) - 1.0) <= 0.01  # type: ignore[arg-type]
    )
    met = met and metering_met
    ratio = {}
    if base is not None:
        ratio = {
            "latency_p50": stats.ratio(chaos.latency_ms["p50"], base.latency_ms["p50"]),
            "latency_p99": stats.ratio(chaos.latency_ms["p99"], base.latency_ms["p99"]),
        }
    claims = {"chaos accepted": chaos.verdict.accepted, "chaos results": chaos.verdict.answered}
    if base is not None:
        claims |= {"baseline accepted": base.verdict.accepted}
    if args.kills:
        claims |= {"kills restarted": sum(k.back is not None for k in chaos.kills)}
    result = {
        "bench": "chaos",
        "subject": subject,
        "baseline": baseline,
        "ratio": ratio,
        "target": TARGET,
        "met": met,
        "measured": stats.require(claims),
        "params": {k: v for k, v in vars(args).items() if k != "keep"},
        "machine": stats.machine(),
    }
    if args.keep:
        print(f"run directory kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
