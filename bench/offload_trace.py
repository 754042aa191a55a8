"""Benchmark companion: where an offloaded job's time goes, leg by leg.

Runs ``bench/offload_path.py`` (its own table and ``RESULT`` line are printed as they are)
with every campus node stamping each message it hands to a handler or publishes, and the
broker each Redis reservation (``bench/trace/sitecustomize.py``; nothing else changes in
the processes). Then prints, for the subject jobs (``off-*``, after the warm-up) and the
baseline's (``dir-*``), the median and 90th percentile of each step between two stamps,
in the order a job takes them; beside them, the edge's acceptance commit (the work waits
for it when the broker's reply comes first); and one ``RESULT {...}`` line (BENCHMARKS.md).
The stamps cost a few µs each, on every process of the path: read the steps, not the totals.

    .venv/bin/python bench/offload_trace.py                 # about 40 s on 2 cores
    .venv/bin/python bench/offload_trace.py --jobs 2000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402

# (stamp, stamp): one step of a subject job, in order (role.kind.what the topic carries).
SUBJECT_STEPS = [
    ("edge.in.jobs", "edge.out.request", "edge: admission, SHA-256, request out"),
    ("edge.out.request", "broker.in.request", "edge -> broker: the request"),
    ("broker.in.request", "broker.redis.reserve", "broker: inbox, decision, hold"),
    ("broker.redis.reserve", "broker.redis.reserved", "broker: Redis reservation"),
    ("broker.redis.reserved", "broker.out.placement", "broker: token minted, reply out"),
    ("broker.out.placement", "edge.in.placement", "broker -> edge: the reply"),
    ("edge.in.placement", "edge.out.work", "edge: token verified, work out"),
    ("edge.out.work", "pool.in.work", "edge -> worker: the image"),
    ("pool.in.work", "pool.out.returns", "worker: verify, decode, infer, return"),
    ("pool.out.returns", "edge.in.returns", "worker -> edge: the result"),
    ("edge.in.returns", "edge.out.results", "edge: the result forwarded"),
]
# Beside the path: the edge's acceptance commit, from the request's arrival.
SIDE_STEPS = [
    ("edge.in.jobs", "edge.outbox.accepted", "edge: acceptance committed (beside the path)"),
    ("edge.in.placement", "edge.outbox.accepted", "edge: commit lands after the reply by"),
]
BASELINE_STEPS = [
    ("pool.in.work", "pool.out.returns", "worker: verify, decode, infer, return"),
]


def read_stamps(directory: Path) -> dict[str, dict[str, float]]:
    """Per job: the first time of each stamp."""
    jobs: dict[str, dict[str, float]] = defaultdict(dict)
    for log in directory.glob("*.log"):
        for line in log.read_text().splitlines():
            at, _pid, role, kind, tail, job = line.split(" ")
            if job != "-":
                jobs[job].setdefault(f"{role}.{kind}.{tail}", float(at))
    return jobs


def between_ms(
    jobs: dict[str, dict[str, float]], prefix: str, start: str, end: str, skip: int
) -> list[float]:
    """From stamp ``start`` to ``end`` of each ``prefix-N`` job past the warm-up, in ms."""
    return [
        (stamps[end] - stamps[start]) * 1000.0
        for job, stamps in jobs.items()
        if job.startswith(prefix)
        and int(job.split("-")[1]) >= skip
        and start in stamps
        and end in stamps
    ]


def steps_ms(
    jobs: dict[str, dict[str, float]], prefix: str, steps: list[tuple[str, str, str]], skip: int
) -> list[tuple[str, float, float, int]]:
    rows = []
    for start, end, name in steps:
        values = between_ms(jobs, prefix, start, end, skip)
        if values:
            rows.append(
                (name, stats.percentile(values, 50), stats.percentile(values, 90), len(values))
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=800)
    ap.add_argument("--warmup", type=int, default=200)
    args, rest = ap.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="sg-trace-") as tmp:
        env = {
            **os.environ,
            "SG_TRACE": tmp,
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "bench" / "trace"), os.environ.get("PYTHONPATH", "")]
            ),
        }
        argv = [sys.executable, str(ROOT / "bench" / "offload_path.py")]
        argv += ["--jobs", str(args.jobs), "--warmup", str(args.warmup), *rest]
        subprocess.run(argv, env=env, check=True)
        jobs = read_stamps(Path(tmp))
    subject = steps_ms(jobs, "off-", SUBJECT_STEPS, args.warmup)
    baseline = steps_ms(jobs, "dir-", BASELINE_STEPS, args.warmup)
    side = steps_ms(jobs, "off-", SIDE_STEPS, args.warmup)
    gaps = between_ms(jobs, "off-", "edge.in.placement", "edge.outbox.accepted", args.warmup)
    waited = stats.ratio(sum(gap > 0 for gap in gaps), len(gaps))
    print(f"\n{'step of an offloaded job (traced)':46}{'p50 ms':>9}{'p90 ms':>9}{'jobs':>7}")
    for name, p50, p90, n in subject:
        print(f"{name:46}{p50:9.3f}{p90:9.3f}{n:7d}")
    for name, p50, p90, n in baseline:
        print(f"{'baseline ' + name:46}{p50:9.3f}{p90:9.3f}{n:7d}")
    for name, p50, p90, n in side:
        print(f"{name:46}{p50:9.3f}{p90:9.3f}{n:7d}")
    print(f"{'share of jobs whose reply beat the commit':46}{waited:9.3f}")
    result = {
        "bench": "offload_trace",
        "subject_steps_ms": {name: {"p50": p50, "p90": p90} for name, p50, p90, _ in subject},
        "baseline_steps_ms": {name: {"p50": p50, "p90": p90} for name, p50, p90, _ in baseline},
        "side_steps_ms": {name: {"p50": p50, "p90": p90} for name, p50, p90, _ in side},
        "reply_beat_commit_share": waited,
        "measured": stats.require(
            {
                f"{prefix}* jobs through '{name}'": len(
                    between_ms(jobs, prefix, start, end, args.warmup)
                )
                for prefix, steps in (("off-", SUBJECT_STEPS), ("dir-", BASELINE_STEPS))
                for start, end, name in steps
            }
        ),
        "params": {"jobs": args.jobs, "warmup": args.warmup},
        "machine": stats.machine(),
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
