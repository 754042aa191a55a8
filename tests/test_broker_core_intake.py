"""The telemetry backlog's rules: the latest sample per node, oldest first, shed when old."""

from __future__ import annotations

from broker.core.intake import Backlog


def test_a_newer_sample_replaces_the_unread_one_and_is_counted_coalesced() -> None:
    backlog = Backlog(shed_after_s=2.0)
    backlog.offer("e1", b"old", 10.0)
    backlog.offer("e2", b"other", 10.1)
    backlog.offer("e1", b"new", 10.2)
    taken = backlog.take(10, 10.3)
    assert taken.samples == [("e2", b"other"), ("e1", b"new")]  # e1 moved behind e2
    assert (backlog.coalesced, backlog.shed, len(backlog)) == (1, 0, 0)


def test_take_reads_a_slice_at_a_time_oldest_first() -> None:
    backlog = Backlog(shed_after_s=2.0)
    for i in range(5):
        backlog.offer(f"e{i}", b"x", 10.0 + i / 100)
    assert [n for n, _ in backlog.take(2, 10.1).samples] == ["e0", "e1"]
    assert backlog.oldest_age(10.1) == 10.1 - 10.02
    assert [n for n, _ in backlog.take(10, 10.1).samples] == ["e2", "e3", "e4"]
    assert backlog.oldest_age(11.0) == 0.0


def test_samples_waiting_past_shed_after_are_dropped_unread_and_counted() -> None:
    backlog = Backlog(shed_after_s=2.0)
    backlog.offer("late-1", b"a", 10.0)
    backlog.offer("late-2", b"b", 10.5)
    backlog.offer("fresh", b"c", 12.4)
    taken = backlog.take(1, 12.6)
    assert taken.samples == [("fresh", b"c")]
    assert taken.shed == 2
    assert backlog.shed == 2
    assert len(backlog) == 0
