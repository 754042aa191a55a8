"""The hand-off budget between a network thread and the event loop (pure threading)."""

from __future__ import annotations

import threading

import pytest

from sluicegate.handoff import Budget


def _taker(budget: Budget, size: int, taken: threading.Event, stop: threading.Event) -> None:
    if budget.take(size, give_up=stop.is_set, poll_s=0.01):
        taken.set()


def _start(budget: Budget, size: int) -> tuple[threading.Event, threading.Event]:
    taken, stop = threading.Event(), threading.Event()
    threading.Thread(target=_taker, args=(budget, size, taken, stop), daemon=True).start()
    return taken, stop


def test_a_taker_waits_while_the_bytes_are_spent_and_goes_once_they_are_given_back() -> None:
    budget = Budget(max_items=10, max_bytes=100)
    assert budget.take(60, give_up=lambda: False)
    taken, stop = _start(budget, 50)  # 60 + 50 > 100: must wait
    assert not taken.wait(0.2)
    budget.give_back(60)
    assert taken.wait(5.0)
    assert (budget.items, budget.bytes) == (1, 50)
    stop.set()


def test_a_taker_waits_while_the_items_are_spent() -> None:
    budget = Budget(max_items=2, max_bytes=10**9)
    assert budget.take(1, give_up=lambda: False)
    assert budget.take(1, give_up=lambda: False)
    taken, stop = _start(budget, 1)
    assert not taken.wait(0.2)
    budget.give_back(1)
    assert taken.wait(5.0)
    stop.set()


def test_one_message_larger_than_the_budget_passes_alone() -> None:
    budget = Budget(max_items=10, max_bytes=100)
    assert budget.take(1_000, give_up=lambda: False)  # nothing else held: it may pass
    taken, stop = _start(budget, 1)
    assert not taken.wait(0.2)  # but nothing joins it
    budget.give_back(1_000)
    assert taken.wait(5.0)
    stop.set()


def test_giving_up_while_waiting_returns_false_and_holds_nothing() -> None:
    budget = Budget(max_items=1, max_bytes=100)
    assert budget.take(10, give_up=lambda: False)
    assert not budget.take(10, give_up=lambda: True, poll_s=0.01)
    assert (budget.items, budget.bytes) == (1, 10)


def test_bad_limits_and_extra_releases_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="at least 1 item and 1 byte; got 0 items"):
        Budget(max_items=0, max_bytes=10)
    budget = Budget(max_items=1, max_bytes=10)
    with pytest.raises(RuntimeError, match="released more often than it was taken"):
        budget.give_back(1)
