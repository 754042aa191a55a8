"""Measures what the outbox costs: one commit per accepted job, and commits grouped.

``python -m edge_agent.outbox_bench [--jobs 500] [--dir PATH]`` prints, for
``synchronous=FULL`` and ``NORMAL``, the commit time (p50/p99, measured around the
transaction; with ``FULL`` the sync behind it, smoothed, and where it ran), the round trip
an awaiting caller sees (submitted → committed at the tick's end, synced → its future
done), and the cost per job when 32 arrive in one loop tick. Run it on the disk the agent's
outbox will live on: fsync cost is a property of that disk.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from edge_agent.admission import Job
from edge_agent.outbox import Outbox, Synchronous
from sluicegate.vision.image import ImageInfo


def _job(i: int, payload: bytes) -> Job:
    return Job(
        f"bench-{i}",
        "defect-v1",
        payload,
        ImageInfo("jpeg", 640, 480),
        "r",
        None,
        5,
        "generic",
        time.time(),
        None,
    )


async def _measure(folder: Path, synchronous: Synchronous, jobs: int) -> str:
    payload = os.urandom(100_000)
    outbox = Outbox(folder / f"bench-{synchronous}.db", synchronous=synchronous)
    await outbox.open()
    trips = []
    for i in range(jobs):
        t = time.perf_counter()
        await outbox.accept(_job(i, payload))
        trips.append(time.perf_counter() - t)
    single = outbox.commit_stats()
    trips.sort()
    commits_before = outbox.commits
    t = time.perf_counter()
    for k in range(jobs // 32):
        await asyncio.gather(*(outbox.accept(_job(jobs + k * 32 + i, payload)) for i in range(32)))
    grouped_s = time.perf_counter() - t
    commits = outbox.commits - commits_before
    await outbox.close()
    per_job = grouped_s / max(1, (jobs // 32) * 32) * 1000.0
    synced = f"  then synced in {single.sync_ms:.3f} ms" if single.sync_ms else ""
    where = (" on a thread" if single.sync_on_thread else " on the loop") if synced else ""
    return (
        f"{synchronous:6}  commit p50 {single.p50_ms:.3f} ms  p99 {single.p99_ms:.3f} ms"
        f"{synced}{where}  "
        f"round trip p50 {trips[len(trips) // 2] * 1000:.3f} ms  "
        f"32 per tick: {per_job:.3f} ms/job in {commits} commits"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for sync in ("FULL", "NORMAL"):
            print(asyncio.run(_measure(Path(folder), sync, args.jobs)))


if __name__ == "__main__":
    main()
