"""One turn of the broker's placement loop, pure: the requests that came together are decided
in order against one view of the fleet, each placed one reserved in that view at once (so
the next decision sees its slot taken), each that found no room offered to the waiting room,
the rest refused (:func:`decide_turn`); once the shared store has answered for the
placements (granted, taken first by another replica, or the job dead-lettered), each is
granted, refused, or given back to be decided again with its worker counted full
(:func:`settle`).

The broker's service (``broker/service.py``) runs a turn, reserves its placements in Redis
in one round trip, settles, and decides again what came back (``service_rules.decide_again``
bounds how often); the twin (``sluicegate.twin``) runs the same turn with one replica, whose
placements are always granted. No I/O, no clock: ``now`` is an argument.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from broker.core.decision import Decision
from broker.core.fleet import Fleet
from broker.core.forwarding import FORWARDABLE
from broker.core.params import PlacementParams
from broker.core.placement import Placed, decide
from policies.model import Policy
from sluicegate.wire_pool import PlacementRequest

T = TypeVar("T")
NO_POLICY = "the broker holds no verified policy"
DEAD_LETTER = "dead_letter"


@dataclass(frozen=True, slots=True)
class Refusal(Generic[T]):
    """A request answered with a refusal: its code and reason, and the decision if one
    was made (the answer explains it)."""

    item: T
    decision: Decision | None
    code: str
    reason: str


@dataclass(slots=True)
class Turn(Generic[T]):
    """What one turn decided: placements reserved in the view (to be reserved in the store),
    refusals, and how many went to the waiting room."""

    placed: list[tuple[T, Placed]] = field(default_factory=list)
    refused: list[Refusal[T]] = field(default_factory=list)
    held: int = 0
    forwarded: int = 0


@dataclass(slots=True)
class Settled(Generic[T]):
    """Placements the store granted, refused (dead-lettered), and those to decide again."""

    granted: list[tuple[T, Placed]] = field(default_factory=list)
    refused: list[Refusal[T]] = field(default_factory=list)
    again: list[T] = field(default_factory=list)


def decide_turn(
    fleet: Fleet,
    items: Sequence[T],
    request_of: Callable[[T], PlacementRequest],
    policy: Policy | None,
    *,
    now: float,
    params: PlacementParams,
    hold: Callable[[T, float], bool],
    sealable: Callable[[PlacementRequest], Callable[[str], bool] | None],
    beside: Callable[[PlacementRequest, Decision], None] | None = None,
    forward: Callable[[T, float], bool] | None = None,
) -> Turn[T]:
    """Decide ``items`` in order; ``forward(item, now)`` offers one refused for want of a
    worker here, or placed where it would finish after its deadline, to a sister campus
    (True: asked there; ``broker.core.forwarding``); then
    ``hold(item, now)`` one that found no room to the waiting room (True: it waits there);
    ``sealable(request)``: the workers its images may be sealed to
    (``broker.core.sealing.sealable_in``); ``beside`` sees every decision (the shadow
    candidate)."""
    turn: Turn[T] = Turn()
    for item in items:
        if policy is None:
            turn.refused.append(Refusal(item, None, "no_policy", NO_POLICY))
            continue
        request = request_of(item)
        decision = decide(
            fleet, request, policy, now=now, params=params, sealable=sealable(request)
        )
        if beside is not None:
            beside(request, decision)
        if isinstance(decision, Placed):
            deadline = request.deadline_at
            late = deadline is not None and now + decision.predicted_ms / 1000.0 > deadline
            if late and forward is not None and forward(item, now):
                turn.forwarded += 1  # a sister campus answers in time where this one cannot
                continue
            fleet.reserve(
                decision.worker_id, request.job_id, now, request.model, decision.predicted_ms
            )
            turn.placed.append((item, decision))
        elif forward is not None and decision.code in FORWARDABLE and forward(item, now):
            turn.forwarded += 1
        elif decision.code == "no_capacity" and hold(item, now):
            turn.held += 1
        else:
            turn.refused.append(Refusal(item, decision, decision.code, decision.reason))
    return turn


def settle(
    fleet: Fleet,
    placed: Sequence[tuple[T, Placed]],
    granted: Sequence[bool | str],
    request_of: Callable[[T], PlacementRequest],
    *,
    now: float,
) -> Settled[T]:
    """The store's answer for each placement (True: reserved; False: another replica
    filled the worker first; a string: the job is dead-lettered, why): a placement not
    granted is released from the view; a lost race also counts its worker full, and its
    request is decided again."""
    out: Settled[T] = Settled()
    for (item, decision), ok in zip(placed, granted, strict=True):
        if isinstance(ok, str):  # dead-lettered: never placed again
            fleet.release(request_of(item).job_id)
            reason = f"the job is dead-lettered: {ok}"
            out.refused.append(Refusal(item, None, DEAD_LETTER, reason))
        elif ok:
            out.granted.append((item, decision))
        else:
            fleet.release(request_of(item).job_id)
            fleet.mark_full(decision.worker_id, now)
            out.again.append(item)
    return out
