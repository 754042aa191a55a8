"""The waiting room: priority levels, earliest deadline first, ageing, bounds."""

from __future__ import annotations

import pytest

from broker.core.mlfq import MLFQ, Waiting
from broker.errors import InvalidParams

T0 = 1_000.0


def job(job_id: str, priority: int, deadline: float | None = None, at: float = T0) -> Waiting[str]:
    return Waiting(job_id, priority, deadline, at, f"item-{job_id}")


def drain(queue: MLFQ[str], now: float) -> list[str]:
    out = []
    while (w := queue.pop_ready(now)) is not None:
        out.append(w.job_id)
    return out


@pytest.mark.parametrize(
    ("jobs", "order"),
    [
        # higher priority first
        ([("a", 1, None), ("b", 9, None), ("c", 5, None)], ["b", "c", "a"]),
        # same level: earliest deadline first, no deadline last
        ([("a", 5, None), ("b", 5, T0 + 3), ("c", 5, T0 + 1)], ["c", "b", "a"]),
        # same level, same deadline: first come first served
        ([("a", 5, T0 + 2), ("b", 5, T0 + 2), ("c", 5, T0 + 2)], ["a", "b", "c"]),
        # priority beats deadline
        ([("a", 4, T0 + 0.5), ("b", 6, T0 + 9)], ["b", "a"]),
    ],
)
def test_order_within_and_across_levels(
    jobs: list[tuple[str, int, float | None]], order: list[str]
) -> None:
    queue: MLFQ[str] = MLFQ(max_wait_s=60.0, age_step_s=10.0)
    for job_id, priority, deadline in jobs:
        assert queue.push(job(job_id, priority, deadline), T0)
    assert len(queue) == len(jobs)
    assert drain(queue, T0) == order
    assert len(queue) == 0


def test_ageing_promotes_a_waiting_job_one_level_per_step() -> None:
    queue: MLFQ[str] = MLFQ(max_wait_s=60.0, age_step_s=1.0)
    queue.push(job("old", 2), T0)
    queue.push(job("new", 4, at=T0 + 1.5), T0 + 1.5)
    assert queue.levels(T0 + 1.5) == {3: 1, 4: 1}
    peeked = queue.peek(T0 + 1.5)
    assert peeked is not None
    assert peeked.job_id == "new"
    # At T0 + 2.5: old is at 2 + 2 = 4, new at 4 + 1 = 5.
    assert queue.levels(T0 + 2.5) == {4: 1, 5: 1}
    # At T0 + 10: old is at 2 + 10 = 12 and new at 4 + 8 = 12: old has caught up, and
    # at one level (no deadlines) the earlier arrival goes first.
    assert queue.levels(T0 + 10.0) == {12: 2}
    assert drain(queue, T0 + 10.0) == ["old", "new"]


def test_a_low_priority_job_beats_a_stream_of_high_priority_ones() -> None:
    queue: MLFQ[str] = MLFQ(max_wait_s=1_000.0, age_step_s=0.05)
    queue.push(job("low", 0, deadline=T0 + 900), T0)
    served = []
    for step in range(1, 200):
        now = T0 + step * 0.01
        # every 10 ms a fresh urgent job with a tighter deadline arrives, and one is served
        queue.push(job(f"hi-{step}", 9, deadline=now + 0.02, at=now), now)
        got = queue.pop_ready(now)
        assert got is not None
        served.append(got.job_id)
        if got.job_id == "low":
            break
    assert "low" in served
    # It waits about (10 - 0) age steps (0.5 s here, 50 arrivals), not forever.
    assert 40 <= served.index("low") <= 60


def test_expired_jobs_are_never_handed_out_and_are_reported_once() -> None:
    queue: MLFQ[str] = MLFQ(max_wait_s=0.05, age_step_s=1.0)
    queue.push(job("late", 9, deadline=T0 + 0.02), T0)
    queue.push(job("slow", 5), T0)
    queue.push(job("fresh", 1, at=T0 + 0.04), T0 + 0.04)
    peeked = queue.peek(T0 + 0.03)
    assert peeked is not None
    assert peeked.job_id == "slow"  # "late" is past its deadline
    assert len(queue) == 3  # until reported
    assert [w.job_id for w in queue.expired(T0 + 0.03)] == ["late"]
    assert queue.expired(T0 + 0.03) == []
    assert drain(queue, T0 + 0.06) == ["fresh"]  # "slow" waited its 50 ms
    assert [w.job_id for w in queue.expired(T0 + 0.06)] == ["slow"]
    assert len(queue) == 0


def test_duplicates_removal_and_putting_back_keeps_the_age() -> None:
    queue: MLFQ[str] = MLFQ(max_wait_s=10.0, age_step_s=1.0)
    first = job("a", 3)
    assert queue.push(first, T0)
    assert not queue.push(job("a", 9), T0)  # a redelivered request: ignored
    assert "a" in queue
    assert queue.remove("a")
    assert not queue.remove("a")
    assert queue.pop_ready(T0) is None
    # A job taken out and put back after 2.5 s is two levels up, as if it had stayed.
    assert queue.push(first, T0 + 2.5)
    queue.push(job("b", 4, at=T0 + 2.5), T0 + 2.5)
    assert queue.levels(T0 + 2.5) == {4: 1, 5: 1}
    assert drain(queue, T0 + 2.5) == ["a", "b"]
    assert queue.pop_ready(T0 + 2.5) is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: MLFQ(max_wait_s=-1.0, age_step_s=1.0), "max_wait_s = -1.0"),
        (lambda: MLFQ(max_wait_s=1.0, age_step_s=0.0), "age_step_s = 0.0"),
        (lambda: MLFQ[str](1.0, 1.0).push(job("x", 10), T0), "priority = 10; accepted: 0 to 9"),
    ],
)
def test_bad_arguments_are_refused(make: object, message: str) -> None:
    with pytest.raises(InvalidParams, match=message):
        make()  # type: ignore[operator]
