"""Which sealing key a placement's token binds: the key the chosen worker advertises, when the
policy lists it for that worker.

A confidential class (``Policy.confidential``) is always sealed; a worker without a usable key
gets no such job (``seal_unavailable``, rather than a token that every node would refuse).
Another class is sealed when the broker is told to seal everything (``[broker] seal_all``)
and the worker has a usable key, and goes in the clear otherwise. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from broker.core.fleet import Fleet
from policies.model import Policy
from policies.sealing import NO_KEY, seal_key_id

SEAL_UNAVAILABLE: Final = "seal_unavailable"


@dataclass(frozen=True, slots=True)
class SealUnavailable:
    """A confidential job placed on a worker it cannot be sealed to."""

    code: str
    reason: str


def can_seal(policy: Policy, worker_id: str, advertised: bytes | None) -> bool:
    """Whether ``worker_id`` advertises a sealing key the policy lists for it."""
    return advertised is not None and policy.seal_key(worker_id, seal_key_id(advertised)) == (
        advertised
    )


def advertised_key(fleet: Fleet, worker_id: str) -> bytes | None:
    """The sealing key ``worker_id``'s capabilities advertise, if any."""
    state = fleet.state(worker_id)
    caps = state.capabilities if state is not None else None
    return caps.seal_key if caps is not None else None


def sealable_in(
    fleet: Fleet, policy: Policy, data_class: str, *, sealed: bool = False
) -> Callable[[str], bool] | None:
    """For a confidential class (or a job ``sealed`` asks to travel sealed: a sister
    campus's), which of ``fleet``'s workers its images can be sealed to
    (``placement.decide(sealable=)``); None for any other: every worker will do."""
    if not (sealed or policy.confidential(data_class)):
        return None

    def sealable(worker_id: str) -> bool:
        return can_seal(policy, worker_id, advertised_key(fleet, worker_id))

    return sealable


def seal_binding(
    policy: Policy,
    worker_id: str,
    advertised: bytes | None,
    data_class: str,
    *,
    seal_all: bool,
    sealed: bool = False,
) -> bytes | SealUnavailable:
    """The key id the token binds (``NO_KEY``: clear), or why a confidential job (or one
    ``sealed`` asks to travel sealed) cannot go."""
    usable = None
    if advertised is not None and can_seal(policy, worker_id, advertised):
        usable = seal_key_id(advertised)
    must = sealed or policy.confidential(data_class)
    if usable is not None and (seal_all or must):
        return usable
    if not must:
        return NO_KEY
    if advertised is None:
        why = "advertises no sealing key"
    else:
        why = f"advertises sealing key {seal_key_id(advertised).hex()}, not one the policy lists"
    whose = "" if policy.confidential(data_class) else ", or to the campus that asks"
    return SealUnavailable(
        SEAL_UNAVAILABLE,
        f"class {data_class!r} is confidential (policy v{policy.version}{whose}): its images "
        f"travel only sealed to the worker's key, and worker {worker_id} {why}; the job runs on "
        "the edge, or list the worker's key ('sluicegate pool seal-key list') in the policy",
    )
