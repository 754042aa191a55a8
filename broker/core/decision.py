"""What a placement decision says: where the job goes, or why it does not go anywhere.

A :class:`Placed` names the worker, its zone (as the policy declares it, which is what the
token binds) and the predicted completion time; a :class:`Refused` carries a stable code
and a sentence a person can act on. Both carry :class:`Candidates`, the "why": the best
scored workers with the parts of their score, and how many workers each filter removed.
Plain frozen values; :func:`as_record` turns one into JSON-able data for the audit log and
the HTTP explanation. Nothing here decides anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

RefusalCode = Literal[
    "policy_denied",
    "no_worker",
    "no_capacity",
    "no_faster_worker",
    "seal_unavailable",
    "kept_local",  # a learned placement policy keeps it on its edge (broker.core.learned)
]

# Filter reasons, in the order explanations list them.
FILTER_REASONS = (
    "policy",  # online with the model, but in a zone the policy denies for this job
    "not_in_policy",  # online with the model, but in no pool of the policy
    "offline",  # in an allowed zone with the model, but offline or silent
    "cordoned",  # online with the model, but an operator took it out of placement
    "zone_mismatch",  # declares a zone other than the one its pool has in the policy
    "provider",  # lacks every execution provider the model accepts
    "memory",  # too little free memory for the model
    "full",  # jobs held (queued + running + reserved) >= capacity
    "subhealthy",  # eligible but sub-healthy: used only when no healthy worker has room
    "no_model",  # online in an allowed zone, but the model is not loaded there
)


class Candidate(NamedTuple):
    """One scored worker: ``score_ms = predicted_ms + penalty_ms`` and
    ``predicted_ms = transfer_ms + queue_ms + service_ms``. (A named tuple: one is built
    per ranked worker per decision, and it is four times cheaper than a dataclass.)"""

    worker_id: str
    zone: str
    device_class: str
    score_ms: float
    predicted_ms: float
    transfer_ms: float
    queue_ms: float
    service_ms: float
    penalty_ms: float  # added because the load forecast crosses capacity
    load: float  # jobs held / capacity, reservations included
    forecast_load: float  # expected load at the forecast horizon
    subhealthy: bool


@dataclass(frozen=True, slots=True)
class Summary:
    """Workers counted by filter reason for one (data class, origin zone, model)."""

    counts: Mapping[str, int]  # every reason of FILTER_REASONS, plus "eligible"
    eligible: int
    filtered: tuple[tuple[str, int], ...]  # (reason, workers) where workers > 0, in order

    @classmethod
    def of(cls, counts: Mapping[str, int]) -> Summary:
        filtered = tuple((r, counts[r]) for r in FILTER_REASONS if counts.get(r, 0) > 0)
        return cls(counts, counts.get("eligible", 0), filtered)


@dataclass(frozen=True, slots=True)
class Candidates:
    """The why of a decision. ``ranked``: the best scored workers, best first (of the
    sub-healthy ones when no healthy worker had room). ``eligible``: healthy workers that
    passed every filter. ``filtered``: (reason, workers) for each reason that removed any."""

    ranked: tuple[Candidate, ...]
    eligible: int
    filtered: tuple[tuple[str, int], ...]

    def removed(self, reason: str) -> int:
        return dict(self.filtered).get(reason, 0)


@dataclass(frozen=True, slots=True)
class Placed:
    worker_id: str
    zone: str
    predicted_ms: float
    candidates: Candidates
    status: Literal["placed"] = "placed"


@dataclass(frozen=True, slots=True)
class Refused:
    code: RefusalCode
    reason: str
    candidates: Candidates
    status: Literal["refused"] = "refused"


Decision = Placed | Refused


def as_record(decision: Decision) -> dict[str, object]:
    """The decision as JSON-able data (for the audit log and ``GET /jobs/{id}/why``).
    Built field by field: ``dataclasses.asdict`` deep-copies and was a tenth of the
    broker's time per decision."""
    if isinstance(decision, Placed):
        out: dict[str, object] = {
            "status": decision.status,
            "worker_id": decision.worker_id,
            "zone": decision.zone,
            "predicted_ms": decision.predicted_ms,
        }
    else:
        out = {"status": decision.status, "code": decision.code, "reason": decision.reason}
    cands = decision.candidates
    out["candidates"] = {
        "ranked": [c._asdict() for c in cands.ranked],
        "eligible": cands.eligible,
        "filtered": dict(cands.filtered),
    }
    return out
