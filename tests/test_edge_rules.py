"""Pure tier: the edge's decisions (``edge_agent.rules``), the functions the lifecycle
table and the digital twin call: capacity, the completion prediction, whether to offer a
job or offer it again, what a repeat of a known id gets, and what a replayed job needs."""

from __future__ import annotations

import pytest

from edge_agent import rules
from edge_agent.rules import Outlook


def outlook(*, offload: bool = True, done: float = 0.0, waiting: int = 0) -> Outlook:
    return Outlook("e1", offload, done, waiting, 8, 3, 3, 3.0)


@pytest.mark.parametrize(
    ("deadline", "waiting", "expected"),
    [(None, 0, None), (None, 8, "queue"), (10.0, 0, None), (0.2, 0, "deadline"), (2.0, 8, "queue")],
)
def test_offer_reason(deadline: float | None, waiting: int, expected: str | None) -> None:
    done = rules.predict_completion(0.0, waiting * 0.25, 2, 0.25)
    assert rules.offer_reason(deadline, outlook(done=done, waiting=waiting)) == expected


def test_nothing_is_offered_without_a_broker() -> None:
    assert rules.offer_reason(0.1, outlook(offload=False, done=9.0, waiting=99)) is None


@pytest.mark.parametrize(("work", "expected"), [(0.0, 10.25), (1.0, 10.5), (2.0, 10.75)])
def test_predict_completion_shares_the_work_ahead(work: float, expected: float) -> None:
    assert rules.predict_completion(10.0, work, 4, 0.25) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("ahead", "expected"),
    [
        ({}, 0.0),
        ({"det": 4}, 0.04),
        ({"det": 1, "ocr": 1}, 0.21),  # a detector job behind an OCR run waits for it
        ({"det": 0, "ocr": 2, "new": 3}, 0.4),  # a model not yet timed costs nothing known
    ],
)
def test_work_ahead_weighs_each_job_by_its_own_model(
    ahead: dict[str, int], expected: float
) -> None:
    service = {"det": 0.01, "ocr": 0.2}
    got = rules.work_ahead(ahead, lambda model: service.get(model, 0.0))
    assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("attempt", "deadline", "offload", "expected"),
    [
        (1, 5.0, True, "deadline"),
        (1, None, True, "queue"),
        (3, 5.0, True, None),
        (1, 5.0, False, None),
    ],
)
def test_retry_reason(
    attempt: int, deadline: float | None, offload: bool, expected: str | None
) -> None:
    assert rules.retry_reason(attempt, deadline, outlook(offload=offload)) == expected


@pytest.mark.parametrize(("held", "room"), [(0, True), (11, True), (12, False), (40, False)])
def test_has_room(held: int, room: bool) -> None:
    assert rules.has_room(held, queue_size=10, concurrency=2) is room


@pytest.mark.parametrize(
    ("max_local_runs", "suspects", "slots"),
    [
        (3, 0, 4),  # a job counted behind each of the two threads
        (3, 1, 2),  # a job that held a slot when the agent died is back: threads only
        (1, 0, 2),  # one counted run dead-letters a job: count only what a thread takes
    ],
)
def test_run_slots(max_local_runs: int, suspects: int, slots: int) -> None:
    assert rules.run_slots(2, max_local_runs=max_local_runs, suspects=suspects) == slots


@pytest.mark.parametrize(
    ("stored", "dup", "plan"),
    [
        ("queued", False, "retarget"),
        ("offloaded", True, "retarget"),  # a redelivery of a pending job: still its request
        ("done", False, "republish"),
        ("delivered", False, "republish"),
        ("delivered", True, "redelivered"),
        (None, False, "forgotten"),
        (None, True, "redelivered"),
    ],
)
def test_repeat_plan(stored: rules.StoredState | None, dup: bool, plan: str) -> None:
    assert rules.repeat_plan(stored, dup=dup) == plan


@pytest.mark.parametrize("stored", ["queued", "delivered", None])
def test_a_repeat_known_in_memory_but_gone_from_disk_is_tracked_anew(
    stored: rules.StoredState | None,
) -> None:
    assert rules.repeat_plan(stored, dup=False, on_disk=False) == "track"
    assert rules.repeat_plan(stored, dup=True, on_disk=False) == "track"


@pytest.mark.parametrize(
    ("state", "runs", "plan"),
    [
        ("done", 0, "republish"),
        ("offloaded", 9, "await_return"),
        ("queued", 3, "dead_letter"),
        ("queued", 2, "route"),
    ],
)
def test_replay_plan(state: rules.StoredState, runs: int, plan: str) -> None:
    assert rules.replay_plan(state, runs, 3) == plan


def test_expiry_reason_is_none_before_the_deadline() -> None:
    assert rules.expiry_reason(None, 5.0) is None
    assert rules.expiry_reason(6.0, 5.0) is None
    assert rules.expiry_reason(5.0, 5.0) == (
        "the deadline passed 0 ms ago, before the job could start; not run"
    )


@pytest.mark.parametrize(
    ("deadline", "free", "dup", "expected"),
    [
        (10.0, True, False, (True, None)),  # on time, a slot free: run now, counted with it
        (10.0, False, False, (False, None)),  # on time, queue first
        (0.2, True, False, (False, "deadline")),  # late here: ask while it commits
        (0.2, True, True, (False, None)),  # a redelivery: asked only once accepted
    ],
)
def test_intake(deadline: float, free: bool, dup: bool, expected: tuple[bool, str | None]) -> None:
    done = rules.predict_completion(0.0, 0.0, 2, 0.25)
    got = rules.intake(deadline, outlook(done=done), slot_free=free, redelivered=dup)
    assert got == expected


def test_the_declined_share_follows_the_brokers_answers() -> None:
    share = 1.0  # no history: every job still asking counts as staying
    for _ in range(20):
        share = rules.declined_share(share, placed=True)
    assert share < 0.02  # a broker placing everything: almost nothing asking will stay
    once = rules.declined_share(share, placed=False)
    assert once == pytest.approx(share + rules.DECLINED_WEIGHT * (1.0 - share))


def test_expected_work_weighs_what_is_still_asking_and_leaves_out_the_job_itself() -> None:
    assert rules.expected_work(0.4, 1.0, 0.5) == pytest.approx(0.9)
    assert rules.expected_work(0.4, 1.0, 0.5, own_s=0.25) == pytest.approx(0.65)
    assert rules.expected_work(0.0, 0.0, 0.5, own_s=0.1) == 0.0  # never below nothing


@pytest.mark.parametrize(
    ("predicted_done", "answer_due", "expected"),
    [
        (9.3, None, 9.7),  # a run here takes 0.3 s: it must start by 9.7 for a 10.0 deadline
        (9.3, 9.5, 9.7),  # the worker is due at 9.5: silence past 9.7 is a fault, rescued
        (9.3, 9.8, None),  # due after 9.7: a run here then would only run it twice
        (9.3, 10.5, 9.7),  # due after the deadline: only a run here can meet it
        (10.1, None, None),  # a run here cannot meet the deadline at all
    ],
)
def test_rescue_at(predicted_done: float, answer_due: float | None, expected: float | None) -> None:
    got = rules.rescue_at(10.0, 9.0, predicted_done, answer_due)
    assert got == (None if expected is None else pytest.approx(expected))
