"""Lint for policies: mistakes a schema cannot see, found before anyone signs.

Errors: a pool, edge or rule naming a zone the policy does not declare; one key in two roles;
one id used by two kinds of node or app (they would share an MQTT user). Warnings: rules
shadowed by deny rules or made redundant by an earlier rule, classes no zone may process,
one key under two ids, published test keys, a confidential class that may run where a
worker lists no sealing key. Coverage is computed exactly over the declared zones. Pure: it
reports and never changes a policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from policies.keys import public_key_text
from policies.loader import format_loc
from policies.model import Policy, Rule, ZonePattern
from policies.schema import Loc

# Public halves of the deterministic keys in tests/policies/policy_testkit.py (their private
# halves are derivable by anyone) and of the shipped example policy.
PUBLISHED_TEST_KEYS = frozenset(
    {
        "ed25519:AywAB7OMfOpArWZtt5SbbElYZUHlE4eknDFZ2Fsdnw8",
        "ed25519:Mk9R80APMi_aBFwfU0Aj2vNfvIwKC_nPZiRrMbPoBmY",
        "ed25519:i-OKZ7VuI4DzdtUobmn7Zn4OD2Bb7suv3YF5bB3zSlo",
        "ed25519:UXUhRMi0tlkX61fLoI5JtRDLhGRQWu6iGrqrm09x_UI",
        "ed25519:U0bvgXrI6YbpHqyAYJtAyayzJ-6pgyu5WIRL0K-XRo4",
        "ed25519:iJkMFG-yXCWxOag-u_UolvmC21aJXG-8lnLLbtjJcyQ",
        "ed25519:m_xn-iLOI4LhcBIg3hNHm4WNMuP8vbfvCMZB0KpOB-A",
        "ed25519:xolDtOPTywjZmk6-OdFdfIB2xxVbSW5b84lDP-3DPcM",
        "ed25519:P2EvJciVu0hTkVf0GpUaBYAVnyESPJf_Vo-GnV0DqaE",
        "ed25519:UW5UqX0xf7FeIFDc-fEucSiL_NG3YQFv1ZpydrTzDKE",
        "ed25519:hpAwBcK7b9wd5OUXezgmPkh2uetZtABmbmUqjxNfpn4",
        "ed25519:a_xXXxfmk0M_3iJfuhyNmVfEHmB2otFKqF2XDk-tbdQ",
    }
)


@dataclass(frozen=True)
class Finding:
    severity: Literal["error", "warning"]
    code: str
    loc: Loc
    message: str

    @property
    def key(self) -> str:
        return format_loc(self.loc)


def _rule_loc(rule: Rule) -> Loc:
    return ("classes", rule.data_class, rule.effect, rule.index)


class _Coverage:
    """Which declared zones each rule's origin and target patterns match."""

    def __init__(self, policy: Policy) -> None:
        self.zones = policy.zone_segments
        self._memo: dict[ZonePattern, frozenset[str]] = {}

    def _zones(self, pattern: ZonePattern) -> frozenset[str]:
        found = self._memo.get(pattern)
        if found is None:
            found = frozenset(z for z, segs in self.zones.items() if pattern.matches(segs))
            self._memo[pattern] = found
        return found

    def origins(self, rule: Rule) -> frozenset[str]:
        return self._zones(rule.origin)

    def targets(self, rule: Rule) -> frozenset[str]:
        return self._zones(rule.target)

    def denied_targets(self, denies: Iterable[Rule], origin: str) -> set[str]:
        out: set[str] = set()
        for rule in denies:
            if origin in self.origins(rule):
                out |= self.targets(rule)
        return out


def _zone_findings(policy: Policy) -> list[Finding]:
    out: list[Finding] = []
    declared = ", ".join(sorted(policy.zones)[:8])
    for pool in policy.pools:
        if pool.zone not in policy.zones:
            out.append(
                Finding(
                    "error",
                    "unknown-zone",
                    ("pools", pool.name, "zone"),
                    f"pool {pool.name!r} sits in undeclared zone {pool.zone!r}; declared: "
                    f"{declared}",
                )
            )
    for edge in policy.edges:
        if edge.zone not in policy.zones:
            out.append(
                Finding(
                    "error",
                    "unknown-zone",
                    ("edges", edge.edge_id, "zone"),
                    f"edge {edge.edge_id!r} sits in undeclared zone {edge.zone!r}; declared: "
                    f"{declared}",
                )
            )
    return out


def _rule_findings(policy: Policy) -> list[Finding]:
    out: list[Finding] = []
    cov = _Coverage(policy)
    for cls in policy.classes.values():
        live = False
        for effect_rules in (cls.deny, cls.allow):
            for rule in effect_rules:
                origins, targets = cov.origins(rule), cov.targets(rule)
                if not origins or not targets:
                    side = "origin" if not origins else "target"
                    text = rule.origin.text if not origins else rule.target.text
                    out.append(
                        Finding(
                            "error",
                            "unknown-zone",
                            _rule_loc(rule),
                            f"{rule}: {side} pattern {text!r} matches no declared zone",
                        )
                    )
                    continue
                for earlier in effect_rules[: rule.index]:
                    if origins <= cov.origins(earlier) and targets <= cov.targets(earlier):
                        out.append(
                            Finding(
                                "warning",
                                "redundant",
                                _rule_loc(rule),
                                f"{rule} adds nothing: {earlier} already covers it",
                            )
                        )
                        break
                if rule.effect == "allow":
                    open_somewhere = any(targets - cov.denied_targets(cls.deny, o) for o in origins)
                    live = live or open_somewhere
                    if not open_somewhere:
                        out.append(
                            Finding(
                                "warning",
                                "shadowed",
                                _rule_loc(rule),
                                f"{rule} never takes effect: deny rules of the class cover "
                                "every zone pair it allows",
                            )
                        )
        if not live:
            out.append(
                Finding(
                    "warning",
                    "unprocessable-class",
                    ("classes", cls.name),
                    f"no declared zone may process data class {cls.name!r}: it can only run "
                    "where it is produced without offload, if at all",
                )
            )
    return out


def _key_findings(policy: Policy) -> list[Finding]:
    out: list[Finding] = []
    holders: dict[bytes, list[tuple[str, Loc]]] = {}
    for ref in policy.signers:
        holders.setdefault(ref.public, []).append(
            ("policy signer", ("policy_signers", "keys", ref.key_id))
        )
    for ref in policy.brokers:
        holders.setdefault(ref.public, []).append(
            ("broker", ("broker_signers", "keys", ref.key_id))
        )
    for edge in policy.edges:
        holders.setdefault(edge.key, []).append(("edge", ("edges", edge.edge_id, "key")))
    for worker in policy.workers.values():
        holders.setdefault(worker.key, []).append(
            ("worker", ("pools", worker.pool, "workers", worker.worker_id))
        )
    for public, uses in holders.items():
        roles = sorted({role for role, _ in uses})
        names = ", ".join(str(loc[-2] if loc[-1] == "key" else loc[-1]) for _, loc in uses)
        if len(roles) > 1:
            out.append(
                Finding(
                    "error",
                    "shared-key",
                    uses[-1][1],
                    f"one key serves as {' and '.join(roles)} ({names}); give each role its own",
                )
            )
        elif len(uses) > 1:
            out.append(
                Finding(
                    "warning",
                    "duplicate-key",
                    uses[-1][1],
                    f"one key is listed under several ids ({names}); thresholds count it once",
                )
            )
        if public_key_text(public) in PUBLISHED_TEST_KEYS:
            out.append(
                Finding(
                    "warning",
                    "test-key",
                    uses[0][1],
                    f"{names} uses a published test key: anyone can sign with it; replace it "
                    "with a key from 'sluicegate policy keygen'",
                )
            )
    return out


def _id_findings(policy: Policy) -> list[Finding]:
    kinds: dict[str, list[str]] = {}
    for worker in policy.worker_zones:
        kinds.setdefault(worker, []).append("worker")
    for edge in policy.edges:
        kinds.setdefault(edge.edge_id, []).append("edge")
    for ref in policy.brokers:
        kinds.setdefault(ref.key_id, []).append("broker")
    for app in policy.apps:
        kinds.setdefault(app.app_id, []).append("app")
    return [
        Finding(
            "error",
            "id-collision",
            ("edges", name)
            if "edge" in used
            else ("apps", name)
            if "app" in used
            else ("broker_signers", "keys", name),
            f"{name!r} is both {' and '.join(used)}: they would share one MQTT user",
        )
        for name, used in kinds.items()
        if len(used) > 1
    ]


def _seal_findings(policy: Policy) -> list[Finding]:
    """A confidential class whose allow rules reach a pool with a worker that lists no
    sealing key: that worker can never be given the class's jobs."""
    coverage = _Coverage(policy)
    out: list[Finding] = []
    for name, cls in policy.classes.items():
        if not cls.confidential:
            continue
        reachable = set().union(*(coverage.targets(rule) for rule in cls.allow))
        for pool in policy.pools:
            if pool.zone not in reachable:
                continue
            bare = [w for w in pool.workers if not policy.workers[w].seal_keys]
            if bare:
                out.append(
                    Finding(
                        "warning",
                        "confidential-no-seal-key",
                        ("pools", pool.name, "encryption_keys"),
                        f"class {name!r} is confidential and may run in {pool.zone!r}, but "
                        f"{', '.join(bare)} list(s) no encryption key: its jobs never go "
                        "there (add each worker's key from 'sluicegate pool seal-key new')",
                    )
                )
    return out


def check_policy(policy: Policy) -> list[Finding]:
    """Every finding, errors first, in file order within each severity."""
    findings = (
        _zone_findings(policy)
        + _rule_findings(policy)
        + _key_findings(policy)
        + _id_findings(policy)
        + _seal_findings(policy)
    )
    return sorted(findings, key=lambda f: f.severity != "error")
