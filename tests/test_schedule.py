"""Announced work, pure parts: the checks an announcement passes and the refusal each bad
one gets (``sluicegate.schedule``), the edge's book (replace, withdraw, expire, a bound),
and the lead it gives the pools' demand signal (``broker.core.demand``)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from broker.core.demand import announced_per_pool, pool_demand
from broker.core.fleet import Fleet
from broker.core.params import FleetParams
from sluicegate.schedule import MAX_WINDOWS, Book, local_rates, overflow_per_s
from sluicegate.wire import Announced, Announcement, EdgeSchedule
from tests.policies.policy_testkit import base_doc, policy_of

NOW = 1_800_000_000.0
MODELS = ("defect-v1", "ocr-v1")


# A burst of 100 images/s for a minute, starting in 30 s.
WINDOW: dict[str, Any] = {
    "announcement_id": "shift-2",
    "starts_at": NOW + 30,
    "ends_at": NOW + 90,
    "rate_per_s": 100.0,
    "model": "defect-v1",
}


def _a(**kw: Any) -> Announcement:
    return Announcement.model_validate(WINDOW | kw)


def test_a_window_ahead_is_booked_replaced_by_its_id_and_withdrawn() -> None:
    book = Book()
    assert book.take(_a(), NOW, MODELS) is None
    assert book.take(_a(rate_per_s=50.0), NOW, MODELS) is None  # the same id: replaced
    (only,) = book.live(NOW)
    assert only.rate_per_s == 50.0
    assert book.take(_a(withdraw=True), NOW, MODELS) is None
    assert book.live(NOW) == []
    refused = book.take(_a(withdraw=True), NOW, MODELS)
    assert refused is not None
    assert refused.code == "unknown_announcement"


def test_a_window_leaves_the_book_when_it_ends() -> None:
    book = Book()
    assert book.take(_a(), NOW, MODELS) is None
    assert len(book.live(NOW + 89)) == 1
    assert book.live(NOW + 90) == []


@pytest.mark.parametrize(
    ("kw", "code", "words"),
    [
        ({"ends_at": NOW + 30}, "bad_window", "is not after starts_at"),
        ({"starts_at": NOW - 90, "ends_at": NOW - 1}, "window_over", "ended"),
        (
            {"starts_at": NOW + 30 * 86_400, "ends_at": NOW + 30 * 86_400 + 60},
            "too_far_ahead",
            "ahead",
        ),
        ({"ends_at": NOW + 3 * 86_400}, "too_long", "lasts"),
        ({"model": "nope-v9"}, "unknown_model", "no model 'nope-v9'"),
    ],
)
def test_a_bad_announcement_is_refused_by_name_and_books_nothing(
    kw: dict[str, Any], code: str, words: str
) -> None:
    book = Book()
    refused = book.take(_a(**kw), NOW, MODELS)
    assert refused is not None
    assert refused.code == code
    assert words in refused.reason
    assert book.live(NOW) == []


def test_an_edge_keeps_a_bounded_number_of_announcements() -> None:
    book = Book()
    for i in range(MAX_WINDOWS):
        assert book.take(_a(announcement_id=f"a{i}"), NOW, MODELS) is None
    refused = book.take(_a(announcement_id="one-more"), NOW, MODELS)
    assert refused is not None
    assert refused.code == "too_many"
    assert book.take(_a(announcement_id="a0", rate_per_s=7.0), NOW, MODELS) is None  # replace


@pytest.mark.parametrize(
    "kw",
    [{"rate_per_s": 0}, {"rate_per_s": float("nan")}, {"announcement_id": "a b"}, {"extra": 1}],
)
def test_the_wire_refuses_what_no_book_should_see(kw: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        _a(**kw)


def _window(**kw: Any) -> Announced:
    doc = WINDOW | {"data_class": "ocr-crop", "local_per_s": 20.0}
    return Announced.model_validate(doc | kw)


def test_the_overflow_counts_from_the_lead_until_the_window_ends() -> None:
    w = _window()
    assert overflow_per_s([w], NOW, lead_s=10.0) == 0.0  # 30 s ahead, a 10 s lead
    assert overflow_per_s([w], NOW, lead_s=60.0) == 80.0  # beyond what the edge runs
    assert overflow_per_s([w], NOW + 60, lead_s=0.0) == 80.0
    assert overflow_per_s([w], NOW + 90, lead_s=60.0) == 0.0
    assert overflow_per_s([_window(local_per_s=150.0)], NOW + 60, lead_s=0.0) == 0.0


def test_announced_work_leads_the_pools_demand_and_the_measured_rate_takes_over() -> None:
    policy = policy_of(base_doc())
    edge = policy.edges[0]
    doc = EdgeSchedule(node=edge.edge_id, zone=edge.zone, ts=NOW, windows=[_window()])
    ahead = announced_per_pool([doc], policy, NOW, lead_s=60.0)
    assert ahead
    assert abs(sum(ahead.values()) - 80.0) < 1e-9
    assert announced_per_pool([doc], policy, NOW, lead_s=10.0) == {}
    stranger = EdgeSchedule(node="not-listed", zone=edge.zone, ts=NOW, windows=[_window()])
    assert announced_per_pool([stranger], policy, NOW, lead_s=60.0) == {}
    fleet = Fleet(FleetParams(), {}, policy)
    pool = next(iter(ahead))
    quiet = {d.pool: d for d in pool_demand(fleet, policy, arrivals_per_s={pool: 1.0})}
    led = pool_demand(fleet, policy, arrivals_per_s={pool: 1.0}, announced_per_s=ahead)
    told = {d.pool: d for d in led}
    assert told[pool].demand_jobs_s > quiet[pool].demand_jobs_s
    assert told[pool].announced_jobs_s == ahead[pool]
    busy = {pool: ahead[pool] * 2}  # once the burst is measured, the larger rate counts
    there = {
        d.pool: d for d in pool_demand(fleet, policy, arrivals_per_s=busy, announced_per_s=ahead)
    }
    assert there[pool].demand_jobs_s == pytest.approx(busy[pool])


def test_a_book_of_more_windows_than_any_edge_keeps_is_refused_at_the_wire() -> None:
    many = [_window(announcement_id=f"a{i}") for i in range(65)]
    with pytest.raises(ValidationError):
        EdgeSchedule(node="n", zone="z", ts=NOW, windows=many)


def test_windows_that_overlap_share_the_edge_s_slots() -> None:
    capacity = {"defect-v1": 100.0, "ocr-v1": 10.0, "new-v1": 0.0}.__getitem__
    alone = [_a()]  # 100/s of defect-v1, which the edge runs at 100/s: all of it here
    assert local_rates(alone, capacity) == [100.0]
    # With 10/s of OCR over the same minute the two ask for 1 + 1 = twice the slots: each
    # runs half its rate here, the rest goes to the pools.
    both = [_a(), _a(announcement_id="labels", model="ocr-v1", rate_per_s=10.0)]
    assert local_rates(both, capacity) == pytest.approx([50.0, 5.0])
    later = _a(announcement_id="later", model="ocr-v1", rate_per_s=10.0, starts_at=NOW + 90)
    later = later.model_copy(update={"ends_at": NOW + 120})
    assert local_rates([_a(), later], capacity) == [100.0, 10.0]  # no overlap: no sharing
    untimed = _a(announcement_id="new", model="new-v1")
    assert local_rates([_a(), untimed], capacity) == [100.0, 0.0]
