"""Pure tier: the broker service's decisions around a placement (``broker.core.service_rules``)."""

from __future__ import annotations

import pytest

from broker.core import service_rules
from broker.core.params import ServiceParams
from broker.errors import InvalidParams

P = ServiceParams()


@pytest.mark.parametrize(
    ("since", "now", "broker_ms", "edge_ms", "deadline", "expected"),
    [
        (10.0, 10.0, 25.0, 100.0, None, 10.025),  # the broker's wait is the shorter
        (10.0, 10.0, 250.0, 50.0, None, 10.05),  # the edge's is
        (10.0, 10.0, 250.0, 250.0, 10.1, 10.1),  # never past the deadline
        (10.0, 10.3, 250.0, 250.0, None, None),  # waited its time already
        (10.0, 10.0, 0.0, 250.0, None, None),  # no waiting allowed
        (10.0, 10.2, 250.0, 250.0, 10.2, None),  # the deadline is now
    ],
)
def test_answer_by(
    since: float,
    now: float,
    broker_ms: float,
    edge_ms: float,
    deadline: float | None,
    expected: float | None,
) -> None:
    got = service_rules.answer_by(
        since, now, broker_max_wait_ms=broker_ms, edge_max_wait_ms=edge_ms, deadline_at=deadline
    )
    assert got == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize(("deadline", "expected"), [(None, 115.0), (101.0, 115.0), (130.0, 135.0)])
def test_a_reservation_outlives_token_or_deadline_by_the_grace(
    deadline: float | None, expected: float
) -> None:
    got = service_rules.reservation_until(100.0, token_ttl_s=10.0, deadline_at=deadline, params=P)
    assert got == pytest.approx(expected)


def test_a_request_is_decided_again_until_its_decisions_are_spent() -> None:
    assert [service_rules.decide_again(n, P) for n in (1, 2, 3, 4)] == [True, True, False, False]


def test_arrivals_are_smoothed() -> None:
    assert service_rules.arrivals(None, 40.0, P) == 40.0
    assert service_rules.arrivals(10.0, 20.0, P) == pytest.approx(13.0)


@pytest.mark.parametrize(
    "bad", [{"reservation_grace_s": -1.0}, {"race_decisions": 0}, {"arrivals_weight": 0.0}]
)
def test_service_params_name_what_is_accepted(bad: dict[str, float]) -> None:
    (name,) = bad
    with pytest.raises(InvalidParams, match=name):
        ServiceParams(**bad)  # type: ignore[arg-type]
