"""The decisions the broker's service makes around each placement, pure: how long a request
that found no room may wait for one (:func:`answer_by`), until when a placed job's
reservation holds its worker's slot (:func:`reservation_until`), whether a request whose
chosen slot another replica took is decided again (:func:`decide_again`), and the arrival
rate the demand forecast reads (:func:`arrivals`). The service (``broker/service.py``)
calls them with the clock's ``now`` and carries out what they say; their tunables are
:class:`~broker.core.params.ServiceParams`. No I/O, no clock.
"""

from __future__ import annotations

from broker.core.params import ServiceParams


def answer_by(
    since: float,
    now: float,
    *,
    broker_max_wait_ms: float,
    edge_max_wait_ms: float,
    deadline_at: float | None,
) -> float | None:
    """When a request waiting for room since ``since`` must be answered: the shorter of the
    broker's and the edge's waits, never past the job's deadline; None when it may not
    wait at all (no wait allowed, or that moment has passed)."""
    bound_s = min(broker_max_wait_ms, edge_max_wait_ms) / 1000.0
    by = since + bound_s
    if deadline_at is not None:
        by = min(by, deadline_at)
    if bound_s <= 0 or by <= now:
        return None
    return by


def reservation_until(
    now: float, *, token_ttl_s: float, deadline_at: float | None, params: ServiceParams
) -> float:
    """Until when a placement holds its worker's slot: the token's lifetime, or the job's
    deadline if later, plus the grace a completion in flight needs to arrive."""
    horizon = token_ttl_s
    if deadline_at is not None:
        horizon = max(horizon, deadline_at - now)
    return now + horizon + params.reservation_grace_s


def decide_again(decisions: int, params: ServiceParams) -> bool:
    """After ``decisions`` decisions of one request, each losing its slot to another
    replica, whether to decide once more (else it runs locally: ``no_capacity``)."""
    return decisions < params.race_decisions


def arrivals(previous: float | None, rate: float, params: ServiceParams) -> float:
    """A pool's placements per second, smoothed: ``rate`` over the last tick folded into
    the ``previous`` estimate (the first tick's rate when there is none)."""
    if previous is None:
        return rate
    weight = params.arrivals_weight
    return (1.0 - weight) * previous + weight * rate
