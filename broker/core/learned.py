"""A learned placement policy: how the broker ranks the candidates the rules already allow,
and when it keeps a job on its edge instead, from weights trained in the digital twin.

The hard limits stay outside it. ``placement.decide`` filters first (the policy's zones and
data classes, sealing, capacity, health); the learned part only orders the survivors (the
``top_k`` best by the heuristic's score, 3 by default) and may decline to place at all, so
no weight can send a job where the rules do not let it go. Each candidate is described by
:data:`FEATURES`, each a figure the broker already has for it, as a share of the time
the job has left (its deadline less now; one second when it has none) where it is a time:

    score = sum(weight[f] * feature[f])        the lowest score is placed
    keep  = local estimate <= keep_share * time left   (the edge meets it with room to spare)

A policy is a file (``sluicegate-placement-policy/1``, JSON) beside a manifest holding its
sha256 (``<file>.sha256``, the digest of the file's bytes, as ``sha256sum`` writes it): it is
loaded only when they agree, so a policy is an artifact like a model, versioned and signed
off as one. :data:`HEURISTIC` is today's rule written as such a policy (rank by predicted
completion plus the forecast's penalty; never keep), the starting point of training.
Pure: no clock, no I/O but :func:`load` and :func:`save`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.core.decision import Candidate
from broker.core.links import OFF_SITE, SAME_ZONE, link_class
from broker.errors import InvalidParams
from sluicegate.wire_pool import PlacementRequest

FORMAT = "sluicegate-placement-policy/1"
FEATURES = (
    "predicted",  # transfer + queue + service, over the time left
    "transfer",
    "queue",
    "service",
    "penalty",  # the forecast's penalty (load heading past capacity), over the time left
    "load",  # jobs held over capacity, reservations included
    "forecast_load",  # the load expected at the forecast's horizon
    "subhealthy",  # 1 when sub-healthy
    "same_zone",  # 1 in the job's own zone
    "off_site",  # 1 off the campus
)
NO_DEADLINE_MS = 1000.0  # the time left of a job with no deadline, for the shares


@dataclass(frozen=True, slots=True)
class LearnedPolicy:
    """Weights per feature (:data:`FEATURES` order) and the share of the time left under
    which an edge's own estimate keeps the job there (0: never keep)."""

    weights: tuple[float, ...]
    keep_share: float = 0.0
    version: str = "0"
    trained: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.weights) != len(FEATURES):
            raise InvalidParams(
                f"a placement policy has {len(FEATURES)} weights ({', '.join(FEATURES)}); "
                f"this one has {len(self.weights)}"
            )
        if not all(math.isfinite(w) for w in self.weights):
            raise InvalidParams("a placement policy's weights must be finite numbers")
        if not 0.0 <= self.keep_share <= 1.0:
            raise InvalidParams(f"keep_share = {self.keep_share!r}; accepted: 0 to 1")

    def rank(
        self,
        request: PlacementRequest,
        now: float,
        ranked: Sequence[Candidate],
        campus_prefix: str,
    ) -> list[Candidate]:
        """``ranked`` (the rules' survivors) in this policy's order, best first."""
        left = _left_ms(request, now)
        origin = request.origin_zone
        keyed = [(self.score(c, origin, left, campus_prefix), i, c) for i, c in enumerate(ranked)]
        keyed.sort()
        return [c for _s, _i, c in keyed]

    def score(self, c: Candidate, origin: str, left_ms: float, campus_prefix: str) -> float:
        link = link_class(origin, c.zone, campus_prefix)
        w = self.weights
        return (
            w[0] * c.predicted_ms / left_ms
            + w[1] * c.transfer_ms / left_ms
            + w[2] * c.queue_ms / left_ms
            + w[3] * c.service_ms / left_ms
            + w[4] * c.penalty_ms / left_ms
            + w[5] * min(c.load, 10.0)
            + w[6] * min(c.forecast_load, 10.0)
            + w[7] * c.subhealthy
            + w[8] * (link == SAME_ZONE)
            + w[9] * (link == OFF_SITE)
        )

    def keeps(self, request: PlacementRequest, now: float) -> bool:
        """True when the edge's own estimate meets the deadline with the room this policy
        asks for: the job is better run there, and no worker is used."""
        if self.keep_share <= 0.0 or request.local_estimate_ms is None:
            return False
        if request.deadline_at is None:
            return False
        return request.local_estimate_ms <= self.keep_share * _left_ms(request, now)

    @classmethod
    def from_mapping(cls, doc: Any, where: str) -> LearnedPolicy:
        """A policy from its plain data (:meth:`describe`'s); :class:`InvalidParams` naming
        ``where`` and the problem."""
        try:
            if doc.get("format") != FORMAT:
                raise InvalidParams(f"placement policy {where}: format {doc.get('format')!r}")
            if list(doc["features"]) != list(FEATURES):
                raise InvalidParams(
                    f"placement policy {where}: features {doc['features']} are not "
                    f"{list(FEATURES)}; retrain it for this broker"
                )
            return cls(
                tuple(float(w) for w in doc["weights"]),
                float(doc.get("keep_share", 0.0)),
                str(doc.get("version", "0")),
                dict(doc.get("trained", {})),
            )
        except (AttributeError, ValueError, KeyError, TypeError) as exc:
            raise InvalidParams(
                f"placement policy {where}: not a placement policy ({exc})"
            ) from exc

    def describe(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "features": list(FEATURES),
            "weights": list(self.weights),
            "keep_share": self.keep_share,
            "trained": self.trained,
        }


# Today's rule as a policy: predicted completion plus the forecast's penalty, never keep.
HEURISTIC = LearnedPolicy((1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0), version="heuristic")


def _left_ms(request: PlacementRequest, now: float) -> float:
    if request.deadline_at is None:
        return NO_DEADLINE_MS
    return max(1.0, (request.deadline_at - now) * 1000.0)


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def save(policy: LearnedPolicy, path: Path) -> str:
    """Write the policy and its manifest; returns the sha256."""
    data = (json.dumps(policy.describe(), indent=2, sort_keys=True) + "\n").encode()
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    digest_path(path).write_text(f"{digest}  {path.name}\n")
    return digest


def load(path: Path) -> LearnedPolicy:
    """The policy in ``path``, once its bytes match its manifest's sha256."""
    return _read(path)[0]


def _read(path: Path) -> tuple[LearnedPolicy, str]:
    """The policy in ``path`` and the sha256 of its bytes, checked against its manifest."""
    try:
        data = path.read_bytes()
        listed = digest_path(path).read_text().split()
    except OSError as exc:
        raise InvalidParams(f"placement policy {path}: {exc.strerror or exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if not listed or listed[0] != digest:
        raise InvalidParams(
            f"placement policy {path}: its sha256 is {digest}, its manifest "
            f"{digest_path(path).name} says {listed[0] if listed else 'nothing'}; refusing it"
        )
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise InvalidParams(f"placement policy {path}: not JSON ({exc})") from exc
    return LearnedPolicy.from_mapping(doc, str(path)), digest


def inline(data: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """A placement file's data (``[learned] file = ..., sha256 = ...``, the file relative to
    ``base``) with the policy it names loaded inline, once the file matches both its
    manifest and the sha256 pinned here, so the placement file's digest (what a twin
    verdict binds) covers the weights. Data without such an entry is returned as it is."""
    entry = data.get("learned")
    if not isinstance(entry, Mapping) or "file" not in entry:
        return dict(data)
    unknown = sorted(set(entry) - {"file", "sha256"})
    if unknown:
        raise InvalidParams(f"[learned]: unknown {', '.join(unknown)}; known: file, sha256")
    path = base / str(entry["file"])
    policy, digest = _read(path)
    if entry.get("sha256") != digest:
        raise InvalidParams(
            f"[learned] file {path} has sha256 {digest}; the placement file pins "
            f'{entry.get("sha256")!r}: pin the file you mean (sha256 = "{digest}")'
        )
    return {**data, "learned": policy.describe()}
