"""Shadow placement: a candidate policy or parameter set deciding beside production on live
traffic, its decisions compared and counted, none of them acted on.

A :class:`Shadow` holds a fleet of its own, fed the same events as production's
(capabilities, telemetry, a worker lost, completions: ``apply_*`` / ``mark_offline``), so
it sees the workers as they really are. For every request production decides, the shell
hands it production's decision; the shadow decides the same request with the candidate's
policy and parameters through the same :func:`~broker.core.placement.decide`, and where it
would place the job it reserves it in its own fleet, so its next decisions see its own
choices until the workers' telemetry takes over (as production's do). Then it compares:

- ``same``: the same worker, or the same refusal code;
- ``moved``: both placed, on different workers (counted by production's and the
  candidate's worker);
- ``candidate_refused`` / ``candidate_placed``: one of them placed and the other refused
  (the candidate's refusal codes counted);
- ``refused_otherwise``: both refused, with different codes.

A candidate placement that the policy *in force* forbids is also counted as ``forbidden``
by data class and zone: the shadow of a policy that would send a campus-only class off
site shows it here, on real traffic, before anyone signs it. Pure: the clock comes in as
``now``, nothing is published; the shell keeps the recent differing decisions for people.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from broker.core.decision import Decision, Placed
from broker.core.fleet import Fleet
from broker.core.params import FleetParams, PlacementParams
from broker.core.placement import decide
from broker.core.sealing import sealable_in
from policies.evaluate import allowed
from policies.model import Policy
from sluicegate.vision.manifest import Requirements
from sluicegate.wire_pool import Completion, PlacementRequest, WorkerCapabilities, WorkerTelemetry

Outcome = Literal["same", "moved", "candidate_refused", "candidate_placed", "refused_otherwise"]
OUTCOMES: tuple[Outcome, ...] = (
    "same",
    "moved",
    "candidate_refused",
    "candidate_placed",
    "refused_otherwise",
)
RECENT = 100  # differing decisions kept for people


def _where(decision: Decision) -> str:
    return decision.worker_id if isinstance(decision, Placed) else f"refused:{decision.code}"


def outcome_of(production: Decision, candidate: Decision) -> Outcome:
    """How the candidate's decision for a request compares with production's."""
    if isinstance(production, Placed):
        if isinstance(candidate, Placed):
            return "same" if candidate.worker_id == production.worker_id else "moved"
        return "candidate_refused"
    if isinstance(candidate, Placed):
        return "candidate_placed"
    return "same" if candidate.code == production.code else "refused_otherwise"


@dataclass(frozen=True, slots=True)
class Compared:
    """One request as both decided it."""

    job_id: str
    model: str
    data_class: str
    outcome: Outcome
    production: str  # worker id, or "refused:<code>"
    candidate: str
    production_ms: float | None  # predicted completion, ms (placed only)
    candidate_ms: float | None
    forbidden: bool  # the candidate's worker is in a zone the policy in force denies

    def as_dict(self) -> dict[str, object]:
        return {
            "job_id": self.job_id,
            "model": self.model,
            "data_class": self.data_class,
            "outcome": self.outcome,
            "production": self.production,
            "candidate": self.candidate,
            "production_ms": self.production_ms,
            "candidate_ms": self.candidate_ms,
            "forbidden": self.forbidden,
        }


@dataclass
class Tally:
    """What the shadow has seen so far."""

    outcomes: Counter[str] = field(default_factory=Counter)
    moved: Counter[tuple[str, str]] = field(default_factory=Counter)  # (production, candidate)
    refusals: Counter[str] = field(default_factory=Counter)  # the candidate's codes
    forbidden: Counter[tuple[str, str]] = field(default_factory=Counter)  # (class, zone)
    recent: deque[Compared] = field(default_factory=lambda: deque(maxlen=RECENT))

    @property
    def decisions(self) -> int:
        return sum(self.outcomes.values())

    def describe(self) -> dict[str, Any]:
        n = self.decisions
        return {
            "decisions": n,
            "agreement": round(self.outcomes["same"] / n, 4) if n else None,
            "outcomes": {o: self.outcomes[o] for o in OUTCOMES},
            "moved": [
                {"production": a, "candidate": b, "jobs": k}
                for (a, b), k in sorted(self.moved.items())
            ],
            "candidate_refusals": dict(sorted(self.refusals.items())),
            "forbidden": [
                {"data_class": c, "zone": z, "jobs": k}
                for (c, z), k in sorted(self.forbidden.items())
            ],
            "recent_differences": [c.as_dict() for c in self.recent],
        }


class Shadow:
    """A candidate's placement beside production; see the module docstring."""

    def __init__(
        self,
        *,
        policy: Policy | None,
        params: PlacementParams,
        fleet_params: FleetParams,
        requirements: Mapping[str, Requirements] | None = None,
        label: str = "candidate",
    ) -> None:
        """``policy``: the candidate policy (None: production's, whichever is in force);
        ``params``: the candidate's placement parameters."""
        self.policy = policy
        self.params = params
        self.label = label
        self.fleet = Fleet(fleet_params, requirements, policy)
        self.tally = Tally()

    # The same events as production's fleet.
    def apply_capabilities(self, caps: WorkerCapabilities, now: float) -> None:
        self.fleet.apply_capabilities(caps, now)

    def apply_telemetry(self, tel: WorkerTelemetry, now: float) -> None:
        self.fleet.apply_telemetry(tel, now)

    def mark_offline(self, worker_id: str, now: float) -> None:
        self.fleet.mark_offline(worker_id, now)

    def mark_stalled(self, worker_id: str, now: float) -> None:
        self.fleet.mark_stalled(worker_id, now)

    def apply_completion(self, done: Completion, now: float) -> None:
        self.fleet.apply_completion(done, now)

    def cordon(self, worker_id: str, cordoned: bool) -> None:
        self.fleet.cordon(worker_id, cordoned)

    def compare(
        self, request: PlacementRequest, production: Decision, in_force: Policy, *, now: float
    ) -> Compared:
        """Decide ``request`` as the candidate would, beside production's ``decision``
        under the policy ``in_force``; count and return the comparison."""
        policy = self.policy or in_force
        sealable = sealable_in(self.fleet, policy, request.data_class)
        candidate = decide(
            self.fleet, request, policy, now=now, params=self.params, sealable=sealable
        )
        forbidden = False
        if isinstance(candidate, Placed):
            self.fleet.reserve(candidate.worker_id, request.job_id, now, request.model)
            zone = in_force.worker_zone(candidate.worker_id)
            verdict = allowed(in_force, request.data_class, request.origin_zone, zone or "")
            forbidden = zone is None or not verdict.allowed
        outcome = outcome_of(production, candidate)
        compared = Compared(
            job_id=request.job_id,
            model=request.model,
            data_class=request.data_class,
            outcome=outcome,
            production=_where(production),
            candidate=_where(candidate),
            production_ms=production.predicted_ms if isinstance(production, Placed) else None,
            candidate_ms=candidate.predicted_ms if isinstance(candidate, Placed) else None,
            forbidden=forbidden,
        )
        tally = self.tally
        tally.outcomes[outcome] += 1
        if outcome == "moved":
            tally.moved[(compared.production, compared.candidate)] += 1
        if not isinstance(candidate, Placed):
            tally.refusals[candidate.code] += 1
        if forbidden and isinstance(candidate, Placed):
            tally.forbidden[(request.data_class, candidate.zone)] += 1
        if outcome != "same" or forbidden:
            tally.recent.append(compared)
        return compared
