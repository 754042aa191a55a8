"""In-memory tier: no compute thread idles through a commit. While the threads compute, the
most urgent queued job has its run counted on disk (a slot behind each thread), so a thread
that finishes takes it at once, and the first thread free takes the most urgent job counted.
After a crash, while a job that held a slot then is back, a job is counted only when a thread
is free for it, as is every job when one counted run dead-letters it.

Compute is held (``HeldExecutor``): a held task is a thread that has not taken its job yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluicegate import topics
from sluicegate.transport import Message
from tests.edge_kit import APP_TOPIC, EDGE, JPEG, EdgeRig


@pytest.fixture
def rigs(tmp_path: Path) -> Iterator[Callable[..., EdgeRig]]:
    loop = asyncio.new_event_loop()
    made: list[EdgeRig] = []

    def make(**options: Any) -> EdgeRig:
        rig = EdgeRig(loop, tmp_path / f"edge-{len(made)}.db", **options)  # 2 threads
        made.append(rig)
        rig.start()
        return rig

    try:
        yield make
    finally:
        for rig in made:
            rig.stop()
        loop.close()


def _runs_at_crash(rig: EdgeRig) -> dict[str, int]:
    """Kill the edge (the outbox is opened exclusively while it runs) and read the local
    runs counted on disk, by job id."""
    rig.crash()
    with contextlib.closing(sqlite3.connect(rig.db)) as conn:
        return dict(conn.execute("SELECT job_id, local_runs FROM jobs").fetchall())


def _request(job_id: str, priority: int = 5) -> Message:
    props = (
        (topics.PROP_MODEL, "defect-v1"),
        (topics.PROP_JOB_ID, job_id),
        (topics.PROP_PRIORITY, str(priority)),
    )
    return Message(
        topics.edge_submit(EDGE),
        JPEG,
        qos=1,
        response_topic=APP_TOPIC,
        correlation_data=job_id.encode(),
        content_type="image/jpeg",
        user_properties=props,
    )


def _submit(rig: EdgeRig, *jobs: tuple[str, int]) -> None:
    """The requests published in one tick: they reach the edge in one turn of its loop."""
    rig.call(lambda: [rig.app.publish_nowait(_request(*job)) for job in jobs])
    rig.settle(compute=False)


def test_the_next_job_is_counted_while_both_threads_compute(
    rigs: Callable[..., EdgeRig],
) -> None:
    rig = rigs()
    for job_id in ("a", "b", "c"):
        _submit(rig, (job_id, 5))
    assert len(rig.executor.held) == 3  # a and b hold the threads, c is handed over ...
    assert _runs_at_crash(rig) == {"a": 1, "b": 1, "c": 1}  # ... its run on disk already


def test_a_burst_gives_the_slots_behind_the_threads_to_its_most_urgent_jobs(
    rigs: Callable[..., EdgeRig],
) -> None:
    rig = rigs()
    _submit(rig, ("a", 5), ("b", 5))
    _submit(rig, ("low", 1), ("mid", 5), ("high", 9), ("top", 9))
    assert _runs_at_crash(rig) == {"a": 1, "b": 1, "low": 0, "mid": 0, "high": 1, "top": 1}


def test_the_first_thread_free_takes_the_most_urgent_job_counted(
    rigs: Callable[..., EdgeRig],
) -> None:
    rig = rigs()
    _submit(rig, ("a", 5), ("b", 5))
    _submit(rig, ("low", 1))
    _submit(rig, ("high", 9))
    assert len(rig.executor.held) == 4  # no thread has taken its job yet
    rig.settle()
    assert [r["job_id"] for r in rig.results()] == ["high", "a", "b", "low"]


def test_after_a_crash_a_job_is_counted_only_with_a_thread_free_while_suspects_are_here(
    rigs: Callable[..., EdgeRig],
) -> None:
    rig = rigs()
    _submit(rig, ("a", 5), ("b", 5))
    _submit(rig, ("c", 5), ("d", 5))
    # Any of the four may have killed it: all come back counted once.
    assert _runs_at_crash(rig) == {"a": 1, "b": 1, "c": 1, "d": 1}
    rig.start()
    rig.settle(compute=False)
    assert len(rig.executor.held) == 2  # two run again, on the two threads; none behind
    assert sorted(_runs_at_crash(rig).values()) == [1, 1, 2, 2]
    rig.start()
    rig.settle()
    assert rig.per_job() == {"a": 1, "b": 1, "c": 1, "d": 1}
    _submit(rig, ("e", 5), ("f", 5))  # the suspects are answered: slots behind the threads
    _submit(rig, ("g", 5))
    assert len(rig.executor.held) == 3


def test_no_job_is_counted_behind_a_thread_when_one_run_dead_letters_it(
    rigs: Callable[..., EdgeRig],
) -> None:
    rig = rigs(max_local_runs=1)
    _submit(rig, ("a", 5), ("b", 5))
    _submit(rig, ("c", 5))
    assert len(rig.executor.held) == 2
    assert _runs_at_crash(rig) == {"a": 1, "b": 1, "c": 0}
