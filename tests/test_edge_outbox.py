"""The edge agent's SQLite outbox: idempotent by job id, group commits, survives SIGKILL,
and says which file is wrong when it cannot be used."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from edge_agent.admission import Job
from edge_agent.errors import OutboxError
from edge_agent.outbox import Outbox
from sluicegate.vision.image import ImageInfo


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def job(job_id: str, *, topic: str = "app/r", corr: bytes | None = b"c1") -> Job:
    return Job(
        job_id,
        "defect-v1",
        b"\xff\xd8jpeg" + job_id.encode(),
        ImageInfo("jpeg", 8, 8),
        topic,
        corr,
        5,
        "generic",
        1_000.0,
        1_005.0,
    )


@pytest.fixture
async def clock() -> Clock:
    return Clock()


@pytest.fixture
async def outbox(tmp_path: Path, clock: Clock) -> AsyncIterator[Outbox]:
    box = Outbox(
        tmp_path / "edge.db", result_retention_s=60, tombstone_s=600, max_tombstones=3, clock=clock
    )
    assert await box.open() == []
    yield box
    await box.close()


async def test_accept_is_idempotent_by_job_id(outbox: Outbox) -> None:
    assert (await outbox.accept(job("a"))).outcome == "new"
    again = await outbox.accept(job("a"))
    assert again.outcome == "known"
    assert again.stored is not None
    assert again.stored.state == "queued"
    assert again.stored.job == job("a")
    # A resubmission under the same id from a new request moves where the result goes.
    moved = await outbox.accept(job("a", topic="app/other", corr=b"c2"))
    assert moved.stored is not None
    assert (moved.stored.job.response_topic, moved.stored.job.correlation_data) == (
        "app/other",
        b"c2",
    )


async def test_only_the_first_result_counts_and_stale_attempts_do_not_match(
    outbox: Outbox,
) -> None:
    await outbox.accept(job("a"))
    assert await outbox.offloaded("a", 1)
    assert await outbox.offloaded("a", 2)
    assert not await outbox.offloaded("a", 2)  # attempts only go up
    assert not await outbox.finish("a", b'{"r":1}', attempt=1)  # stale: fenced
    assert await outbox.finish("a", b'{"r":2}', attempt=2)
    assert not await outbox.finish("a", b'{"r":3}', attempt=2)  # duplicate return
    assert not await outbox.finish("a", b'{"r":4}')  # nor a local result afterwards
    stored = await outbox.get("a")
    assert stored is not None
    assert (stored.state, stored.result, stored.job.payload) == ("done", b'{"r":2}', b"")
    assert await outbox.start_run("a") is None  # a finished job is not run again


async def test_local_runs_are_counted_before_running(outbox: Outbox) -> None:
    await outbox.accept(job("a"), start_run=True)
    await outbox.accept(job("b"))
    assert await outbox.start_run("a") == 2
    assert await outbox.start_run("b") == 1
    await outbox.offloaded("b", 1)
    assert await outbox.start_run("b") == 2  # back to local: state queued again
    stored = await outbox.get("b")
    assert stored is not None
    assert (stored.state, stored.attempt, stored.local_runs) == ("queued", 1, 2)


async def test_one_loop_tick_is_one_commit(outbox: Outbox) -> None:
    before = outbox.commits
    outcomes = await asyncio.gather(*(outbox.accept(job(f"j{i}")) for i in range(20)))
    assert [o.outcome for o in outcomes] == ["new"] * 20
    assert outbox.commits == before + 1
    assert outbox.commit_stats().operations >= 20


async def test_a_delivery_mark_rides_the_next_commit(outbox: Outbox) -> None:
    """A delivery mark opens no commit of its own: it joins the next one an eager write
    opens, and alone it is committed within the lazy delay."""
    await outbox.accept(job("a"))
    await outbox.finish("a", b"{}")
    before = outbox.commits
    marked = outbox.delivered("a")
    await asyncio.sleep(0)  # the loop turns: an eager write would be committed by now
    assert (marked.done(), outbox.commits) == (False, before)
    accepted = outbox.accept(job("b"))
    await asyncio.wait_for(asyncio.gather(marked, accepted), timeout=5)
    assert marked.result() is True
    assert outbox.commits == before + 1
    await outbox.finish("b", b"{}")
    before = outbox.commits
    assert await asyncio.wait_for(outbox.delivered("b"), timeout=5)
    assert outbox.commits == before + 1
    stored = await outbox.get("b")
    assert stored is not None
    assert stored.state == "delivered"


async def test_delivered_results_become_tombstones_then_are_forgotten(
    outbox: Outbox, clock: Clock
) -> None:
    for name in ("a", "b", "c", "d", "e"):
        await outbox.accept(job(name))
        await outbox.finish(name, b"{}")
        assert await outbox.delivered(name)
        clock.now += 1
    assert not await outbox.delivered("a")  # once
    known = await outbox.accept(job("a"))
    assert known.stored is not None
    assert (known.stored.state, known.stored.result) == ("delivered", b"{}")
    clock.now += 100  # past the 60 s retention: results dropped, ids kept (at most 3)
    assert await outbox.prune() == (5, 2)
    assert await outbox.get("e") is None
    assert (await outbox.accept(job("e"))).outcome == "forgotten"
    assert (await outbox.accept(job("a"))).outcome == "new"  # beyond the cap: unknown again
    clock.now += 1000
    assert await outbox.prune() == (0, 3)
    assert (await outbox.accept(job("e"))).outcome == "new"


async def test_a_dead_letters_image_is_kept_past_the_results_retention(
    tmp_path: Path, clock: Clock
) -> None:
    box = Outbox(tmp_path / "edge.db", result_retention_s=60, dead_letter_keep_s=3600, clock=clock)
    await box.open()
    for name in ("dead", "plain"):
        await box.accept(job(name))
    await box.finish("dead", b'{"code":"dead_letter"}', keep_image=True)
    await box.finish("plain", b"{}")
    for name in ("dead", "plain"):
        assert await box.delivered(name)
    dead = await box.get("dead")
    assert dead is not None
    assert dead.job.payload == job("dead").payload  # kept, for a release
    plain = await box.get("plain")
    assert plain is not None
    assert plain.job.payload == b""
    clock.now += 100  # past the results' retention: only the dead letter's row stays
    assert await box.prune() == (1, 0)
    assert await box.get("plain") is None
    assert await box.get("dead") is not None
    clock.now += 3600  # past dead_letter_keep_s: a tombstone like any other
    assert await box.prune() == (1, 0)
    assert await box.get("dead") is None
    assert (await box.accept(job("dead"))).outcome == "forgotten"
    await box.close()


async def test_reopen_returns_unfinished_jobs_in_order(tmp_path: Path) -> None:
    path = tmp_path / "edge.db"
    box = Outbox(path)
    await box.open()
    for name in ("z", "y", "x", "w"):
        await box.accept(job(name))
    await box.offloaded("y", 3, "gpu-7")
    await box.finish("x", b'{"done":1}')
    await box.finish("w", b"{}")
    await box.delivered("w")
    await box.close()
    again = Outbox(path, synchronous="NORMAL")
    rows = await again.open()
    await again.close()
    assert [(r.job.job_id, r.state, r.attempt, r.worker) for r in rows] == [
        ("z", "queued", 0, None),
        ("y", "offloaded", 3, "gpu-7"),  # where the attempt went survives a restart
        ("x", "done", 0, None),
    ]
    assert rows[0].job == job("z")
    assert rows[2].result == b'{"done":1}'


async def test_kill_loses_what_was_not_committed(tmp_path: Path) -> None:
    path = tmp_path / "edge.db"
    box = Outbox(path)
    await box.open()
    await box.accept(job("kept"))
    lost = box.accept(job("lost"))  # submitted, never handed to the writer
    box.kill()
    again = Outbox(path)
    assert [r.job.job_id for r in await again.open()] == ["kept"]
    assert not lost.done()  # a killed outbox never reports back
    await again.close()


_CHILD = """
import asyncio, sys, time
from edge_agent.admission import Job
from edge_agent.outbox import Outbox
from sluicegate.vision.image import ImageInfo

async def main():
    box = Outbox(sys.argv[1])
    await box.open()
    for i in range(50):
        j = Job(f"job-{i}", "m", b"payload", ImageInfo("png", 1, 1), "r", b"c", 5, "g",
                time.time(), None)
        await box.accept(j, start_run=True)
    await box.finish("job-7", b"{}")
    print("committed", flush=True)
    while True:
        box.accept(Job("late", "m", b"p", ImageInfo("png", 1, 1), "r", None, 5, "g", 0.0, None))
        await asyncio.sleep(0.001)

asyncio.run(main())
"""


async def test_commits_survive_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "edge.db"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, str(path), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"committed\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    box = Outbox(path)
    rows = {r.job.job_id: r for r in await box.open()}
    await box.close()
    assert {f"job-{i}" for i in range(50)} <= set(rows)
    assert rows["job-7"].state == "done"
    assert rows["job-3"].local_runs == 1


async def test_corrupt_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "edge.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(OutboxError, match=rf"outbox {path} is not a usable SQLite file"):
        await Outbox(path).open()


async def test_unwritable_places_are_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OutboxError, match=rf"outbox {blocker}/edge\.db: cannot create its dir"):
        await Outbox(blocker / "edge.db").open()
    folder = tmp_path / "folder.db"
    folder.mkdir()
    with pytest.raises(OutboxError, match=rf"outbox {folder} cannot be"):
        await Outbox(folder).open()


async def test_a_commit_the_disk_cannot_sync_is_not_reported_done(tmp_path: Path) -> None:
    """The log is synced behind the commits: a sync that fails fails the operations it was
    to cover, naming the file, rather than passing a commit that may be lost for durable."""
    path = tmp_path / "edge.db"
    box = Outbox(path)
    await box.open()
    os.unlink(f"{path}-wal")  # the log gone under SQLite: nothing can sync it now
    with pytest.raises(OutboxError, match=rf"outbox {path}: .*No such file.*\(not synced\)"):
        await box.accept(job("a"))
    await box.close()


async def test_an_acceptance_written_reports_at_its_commit_and_is_durable_apart(
    tmp_path: Path,
) -> None:
    """``written``: the answer comes once the commit is written (a killed process leaves
    it), before the sync behind it; ``durable`` of the answer's batch resolves once a sync
    covers it, and fails, naming the file, if that sync failed. A run's count reports once
    written too: it guards against a job that kills its process, not against power loss."""
    synced = Outbox(tmp_path / "synced.db")
    await synced.open()
    accepted = await synced.accept(job("a"), written=True)
    assert accepted.outcome == "new"
    await synced.durable(accepted.batch)
    await synced.close()
    path = tmp_path / "edge.db"
    box = Outbox(path)
    await box.open()
    os.unlink(f"{path}-wal")  # the log gone under SQLite: nothing can sync it now
    accepted = await box.accept(job("b"), written=True)
    assert accepted.outcome == "new"
    with pytest.raises(OutboxError, match=rf"outbox {path}: .*\(not synced\)"):
        await box.durable(accepted.batch)
    assert await box.start_run("b") == 1
    await box.close()


async def test_a_slow_disk_is_synced_on_a_thread_the_answers_in_commit_order(
    tmp_path: Path,
) -> None:
    """A disk whose syncs are slow (here: said to be) is synced by the writer's thread while
    the loop commits on: each tick's operations still resolve after a sync that covers
    them, in the order they were committed, and are on disk for the next agent."""
    path = tmp_path / "edge.db"
    box = Outbox(path)
    await box.open()
    syncer = box.writer.syncer
    assert syncer is not None
    syncer.sync_s = 1.0  # as if each sync took a second: every one goes to the thread
    done: list[str] = []
    ticks = []
    for n in range(5):  # one tick each
        accepting = box.accept(job(f"j{n}"))
        accepting.add_done_callback(lambda _f, n=n: done.append(f"j{n}"))
        ticks.append(accepting)
        await asyncio.sleep(0)
    assert [a.outcome for a in await asyncio.gather(*ticks)] == ["new"] * 5
    assert done == [f"j{n}" for n in range(5)]
    assert syncer.thread_syncs >= 1  # then, timed fast, the syncs come back to the loop
    await box.close()
    again = Outbox(path)
    assert [s.job.job_id for s in await again.open()] == [f"j{n}" for n in range(5)]
    await again.close()


async def test_second_agent_on_the_same_outbox_is_refused(outbox: Outbox) -> None:
    with pytest.raises(OutboxError, match=rf"outbox {outbox.path} is in use by another process"):
        await Outbox(outbox.path).open()


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "edge.db"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(OutboxError, match="newer Sluicegate"):
        await Outbox(path).open()


V1_JOBS = """CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY, state TEXT NOT NULL, payload BLOB, response_topic TEXT NOT NULL,
    correlation_data BLOB, model TEXT NOT NULL, image_format TEXT NOT NULL,
    width INTEGER NOT NULL, height INTEGER NOT NULL, priority INTEGER NOT NULL,
    data_class TEXT NOT NULL, received_at REAL NOT NULL, deadline REAL,
    attempt INTEGER NOT NULL DEFAULT 0, local_runs INTEGER NOT NULL DEFAULT 0, result BLOB,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, delivered_at REAL)"""


async def test_an_outbox_of_schema_1_is_migrated_with_its_jobs(tmp_path: Path) -> None:
    path = tmp_path / "edge.db"
    with sqlite3.connect(path) as db:
        db.execute(V1_JOBS)
        db.execute(
            "INSERT INTO jobs (job_id, state, payload, response_topic, model, image_format,"
            " width, height, priority, data_class, received_at, attempt, created_at,"
            " updated_at) VALUES ('old', 'offloaded', x'ffd8', 'app/r', 'defect-v1', 'jpeg',"
            " 8, 8, 5, 'generic', 1.0, 2, 1.0, 1.0)"
        )
        db.execute("PRAGMA user_version = 1")
    box = Outbox(path)
    (row,) = await box.open()
    assert (row.job.job_id, row.state, row.attempt, row.worker) == ("old", "offloaded", 2, None)
    assert await box.offloaded("old", 3, "gpu-1")
    await box.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 3
        assert db.execute("SELECT worker, undeliverable FROM jobs").fetchone() == ("gpu-1", None)


def test_synchronous_is_checked() -> None:
    with pytest.raises(ValueError, match="'OFF'"):
        Outbox("x.db", synchronous="OFF")  # type: ignore[arg-type]


async def test_closed_outbox_refuses_writes(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "edge.db")
    await box.open()
    await box.close()
    with pytest.raises(OutboxError, match="is closed"):
        await box.accept(replace(job("a"), received_at=time.time()))
