"""Pure tier: the dynamic batching core, as tables of arrivals and the batches they make."""

from __future__ import annotations

import math

import pytest

from center_pool import batching
from center_pool.batching import BatchQueue, Entry

# Arrivals: (name, model, arrived, priority, start_by). Times in ms for readability.
Arrival = tuple[str, str, float, int, float | None]


def _queue(
    arrivals: list[Arrival], *, max_batch: int = 4, window_ms: float = 2.0
) -> BatchQueue[str]:
    queue: BatchQueue[str] = BatchQueue(max_batch=max_batch, window_s=window_ms / 1000, capacity=64)
    for name, model, at, priority, start_by in arrivals:
        by = start_by / 1000 if start_by is not None else None
        assert queue.push(Entry(name, model, at / 1000, priority, by))
    return queue


def _drain(queue: BatchQueue[str], now_ms: float) -> list[tuple[str, tuple[str, ...], str]]:
    out: list[tuple[str, tuple[str, ...], str]] = []
    while (batch := queue.pop(now_ms / 1000)) is not None:
        out.append((batch.model, batch.items, batch.reason))
    return out


@pytest.mark.parametrize(
    ("arrivals", "now_ms", "expected"),
    [
        pytest.param([], 10.0, [], id="empty"),
        pytest.param([("a", "m", 0, 5, None)], 1.0, [], id="inside the window nothing is ready"),
        pytest.param(
            [("a", "m", 0, 5, None), ("b", "m", 1, 5, None)],
            2.0,
            [("m", ("a", "b"), "window")],
            id="the window of the oldest job closes",
        ),
        pytest.param(
            [(n, "m", 0.1 * i, 5, None) for i, n in enumerate("abcdef")],
            0.6,
            [("m", ("a", "b", "c", "d"), "full")],
            id="a full group goes at once, the rest waits for its window",
        ),
        pytest.param(
            [(n, "m", 0.1 * i, 5, None) for i, n in enumerate("abcdef")],
            5.0,
            [("m", ("a", "b", "c", "d"), "full"), ("m", ("e", "f"), "window")],
            id="under load: full batch then the remainder",
        ),
        pytest.param(
            [("a", "m1", 0, 5, None), ("b", "m2", 0.5, 5, None), ("c", "m1", 1, 5, None)],
            3.0,
            [("m1", ("a", "c"), "window"), ("m2", ("b",), "window")],
            id="models never mix; the older group goes first",
        ),
        pytest.param(
            [("a", "m1", 0, 5, None), ("b", "m2", 0.5, 5, 0.8)],
            1.0,
            [("m2", ("b",), "deadline")],
            id="a job that must start now flushes its group before the window",
        ),
        pytest.param(
            [("a", "m1", 0, 5, None), ("b", "m2", 0.5, 5, 1.5)],
            2.5,
            [("m2", ("b",), "deadline"), ("m1", ("a",), "window")],
            id="the most urgent ready group goes first",
        ),
        pytest.param(
            [
                ("lo1", "m", 0, 1, None),
                ("lo2", "m", 0, 1, None),
                ("hi", "m", 0.2, 9, None),
                ("dl", "m", 0.3, 1, 50.0),
                ("lo3", "m", 0.4, 1, None),
            ],
            0.5,
            [("m", ("hi", "dl", "lo1", "lo2"), "full")],
            id="inside a full group: priority, then deadline, then arrival",
        ),
    ],
)
def test_batches(
    arrivals: list[Arrival], now_ms: float, expected: list[tuple[str, tuple[str, ...], str]]
) -> None:
    assert _drain(_queue(arrivals), now_ms) == expected


def test_ready_at_names_the_next_flush() -> None:
    queue = _queue([("a", "m", 1.0, 5, None), ("b", "n", 0.5, 5, 1.8)])
    assert queue.ready_at() == pytest.approx(0.0018)
    assert queue.pop(0.0017) is None
    assert _queue([]).ready_at() is None
    full = _queue([(n, "m", 0, 5, None) for n in "abcd"])
    assert full.ready_at() == -math.inf


def test_drain_takes_everything_regardless_of_window() -> None:
    queue = _queue([("a", "m", 0, 5, None), ("b", "n", 0, 5, None)], window_ms=1000)
    assert queue.pop(0.001) is None
    first = queue.pop(0.001, drain=True)
    second = queue.pop(0.001, drain=True)
    assert first is not None
    assert second is not None
    assert {first.items, second.items} == {("a",), ("b",)}
    assert first.reason == "drain"
    assert len(queue) == 0
    assert queue.pop(0.001, drain=True) is None


def test_capacity_refuses_and_depth_counts() -> None:
    queue: BatchQueue[int] = BatchQueue(max_batch=2, window_s=0, capacity=3)
    assert [queue.push(Entry(i, "m", 0.0)) for i in range(4)] == [True, True, True, False]
    assert (len(queue), queue.depth("m"), queue.depth("other")) == (3, 3, 0)
    batch = queue.pop(0.0)
    assert batch is not None
    assert batch.items == (0, 1)
    assert queue.depth("m") == 1


def test_zero_window_flushes_immediately() -> None:
    queue = _queue([("a", "m", 5.0, 5, None)], window_ms=0)
    assert _drain(queue, 5.0) == [("m", ("a",), "window")]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_batch": 0, "window_s": 0.0, "capacity": 1}, "max_batch"),
        ({"max_batch": 1, "window_s": -1.0, "capacity": 1}, "window_s"),
        ({"max_batch": 1, "window_s": math.nan, "capacity": 1}, "window_s"),
        ({"max_batch": 1, "window_s": 0.0, "capacity": 0}, "capacity"),
    ],
)
def test_bad_parameters_name_the_value(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BatchQueue(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("deadline", "estimate", "expected"),
    [
        (None, 0.05, None),  # no deadline: never due on its account
        (10.0, None, 4.0),  # nothing measured yet: at once, it does not wait for company
        (10.0, 0.25, 9.75),  # its deadline less the model's batch time
    ],
)
def test_a_job_is_due_to_start_at_its_deadline_less_the_batch_time(
    deadline: float | None, estimate: float | None, expected: float | None
) -> None:
    assert batching.start_by(deadline, 4.0, estimate) == expected


def test_ready_batches_split_expired_jobs_and_fill_only_the_free_slots() -> None:
    # Three models ready at once, one slot free: the batch of expired jobs only is answered
    # without taking the slot; the next batch takes it; the third waits for a slot.
    queue: BatchQueue[str] = BatchQueue(max_batch=4, window_s=0.0, capacity=16)
    deadlines = {"late-1": 1.0, "late-2": 1.5, "ok-1": 9.0, "late-3": 1.0, "ok-2": None}
    for name, model, start in (
        ("late-1", "a", 0.5),
        ("late-2", "a", 0.6),
        ("ok-1", "b", 0.7),
        ("late-3", "b", 0.7),
        ("ok-2", "c", None),
    ):
        queue.push(Entry(name, model, 0.0, 5, start))
    ready = batching.ready_batches(queue, 2.0, 1, deadlines.get)
    assert [(r.model, r.live, r.expired) for r in ready] == [
        ("a", [], ["late-1", "late-2"]),
        ("b", ["ok-1"], ["late-3"]),
    ]
    assert len(queue) == 1  # "c" waits for a free slot
    assert batching.ready_batches(queue, 2.0, 0, deadlines.get) == []
    (last,) = batching.ready_batches(queue, 2.0, 2, deadlines.get)
    assert (last.model, last.live, last.expired) == ("c", ["ok-2"], [])
