"""One turn of the broker's placement loop (``broker.core.batch``): requests decided in
order against one view, each placement reserved there before the next decision, those
without room offered to the waiting room, the rest refused; the store's answers settled
into grants, dead letters and requests to decide again with the worker counted full."""

from __future__ import annotations

from collections.abc import Callable

from broker.core.batch import Turn, decide_turn, settle
from broker.core.decision import Decision
from broker.core.fleet import Fleet
from policies.model import Policy
from sluicegate.wire_pool import PlacementRequest
from tests.test_broker_core_kit import NDC, NOW, PARAMS, campus_policy, caps, fleet_with, request

POLICY = campus_policy()


def one_worker() -> Fleet:
    return fleet_with(POLICY, [(caps("gpu-1", NDC), {})])


def same(r: PlacementRequest) -> PlacementRequest:
    return r


def turn_of(
    fleet: Fleet,
    items: list[PlacementRequest],
    *,
    policy: Policy | None = POLICY,
    hold: Callable[[PlacementRequest, float], bool] = lambda r, now: True,
    sealable: Callable[[PlacementRequest], Callable[[str], bool] | None] = lambda r: None,
    beside: Callable[[PlacementRequest, Decision], None] | None = None,
) -> Turn[PlacementRequest]:
    return decide_turn(
        fleet,
        items,
        same,
        policy,
        now=NOW,
        params=PARAMS,
        hold=hold,
        sealable=sealable,
        beside=beside,
    )


def test_a_turn_reserves_each_placement_before_the_next_decision() -> None:
    fleet = one_worker()
    room = fleet.headroom("gpu-1")
    assert room > 0
    items = [request(f"job-{i}") for i in range(room + 2)]
    offered: list[str] = []

    def hold(r: PlacementRequest, now: float) -> bool:
        offered.append(r.job_id)
        return len(offered) == 1  # the first without room waits; the room is full after

    turn = turn_of(fleet, items, hold=hold)
    assert [r.job_id for r, _ in turn.placed] == [f"job-{i}" for i in range(room)]
    assert fleet.headroom("gpu-1") == 0
    assert offered == [f"job-{room}", f"job-{room + 1}"]
    assert turn.held == 1
    assert [(x.item.job_id, x.code) for x in turn.refused] == [(f"job-{room + 1}", "no_capacity")]


def test_a_turn_without_a_policy_refuses_every_request_by_name() -> None:
    turn = turn_of(one_worker(), [request("a"), request("b")], policy=None)
    assert not turn.placed
    assert turn.held == 0
    assert {x.code for x in turn.refused} == {"no_policy"}


def test_a_worker_the_image_cannot_be_sealed_to_gets_no_confidential_job() -> None:
    seen: list[tuple[str, str]] = []
    turn = turn_of(
        one_worker(),
        [request("a")],
        sealable=lambda r: lambda worker: False,
        beside=lambda r, d: seen.append((r.job_id, type(d).__name__)),
    )
    assert not turn.placed
    assert [x.code for x in turn.refused] == ["seal_unavailable"]
    assert seen == [("a", "Refused")]  # the shadow sees every decision


def test_settling_grants_refuses_dead_letters_and_decides_a_lost_race_again() -> None:
    fleet = one_worker()
    items = [request("won"), request("dead"), request("raced")]
    turn = turn_of(fleet, items)
    assert len(turn.placed) == 3
    out = settle(fleet, turn.placed, [True, "released by an operator", False], same, now=NOW)
    assert [r.job_id for r, _ in out.granted] == ["won"]
    assert [(x.item.job_id, x.code) for x in out.refused] == [("dead", "dead_letter")]
    assert "released by an operator" in out.refused[0].reason
    assert [r.job_id for r in out.again] == ["raced"]
    # Both given back, and the worker another replica filled counts as full meanwhile.
    assert fleet.reserved("gpu-1") == 1
    assert fleet.headroom("gpu-1") == 0
    again = turn_of(fleet, out.again, hold=lambda r, n: False)
    assert [x.code for x in again.refused] == ["no_capacity"]
