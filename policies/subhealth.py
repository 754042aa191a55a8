"""Sub-health: is a node degraded according to the policy's rules?

A node is sub-healthy when every condition of at least one rule holds (``utilisation >= 0.7``
and ``memory_bandwidth >= 0.9``). A metric that is missing or not a finite number never
satisfies a condition, so no rule fires on data we do not have; the verdict lists such
metrics so the caller can tell "healthy" from "unknown". Pure; knows nothing of telemetry
transport or of what the broker does with the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from policies.model import SubhealthRule


@dataclass(frozen=True)
class HealthVerdict:
    subhealthy: bool
    rule: SubhealthRule | None
    missing: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.rule is not None:
            conds = " and ".join(str(c) for c in self.rule.conditions)
            return f"sub-healthy by rule {self.rule.name!r} ({conds})"
        if self.missing:
            return f"no rule fires; metrics missing or not numbers: {', '.join(self.missing)}"
        return "healthy: no sub-health rule fires"


def is_subhealthy(rules: Iterable[SubhealthRule], metrics: Mapping[str, float]) -> HealthVerdict:
    """The first rule (in policy order) whose every condition holds, or a healthy verdict."""
    missing: set[str] = set()
    for rule in rules:
        fired = True
        for cond in rule.conditions:
            value = metrics.get(cond.metric)
            if not isinstance(value, int | float) or not math.isfinite(value):
                missing.add(cond.metric)
                fired = False
            elif not cond.holds(value):
                fired = False
        if fired:
            return HealthVerdict(True, rule)
    return HealthVerdict(False, None, tuple(sorted(missing)))
