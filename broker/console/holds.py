"""Operators' holds on the campus: a worker drained or cordoned (no new placements), a line
whose offload is paused (its edge runs every job itself).

A hold is plain data, kept in one Redis hash so every replica applies the same holds (the
replica that takes an action applies it at once, the others at their next sync, within a
second). :func:`act` is the pure decision: given the holds in force, an action and what the
policy knows, the new hold (or the one lifted) and the audit record, or an
:class:`ActionRefused` that names the problem. Drain and cordon both stop placements; a
drain is also watched until the worker holds no job in flight, then shown as drained, so
maintenance can start.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from broker.errors import BrokerError

HoldKind = Literal["drain", "cordon", "pause"]
Verb = Literal["drain", "cordon", "uncordon", "pause", "resume", "release"]
ON_WORKERS = ("drain", "cordon", "uncordon")
ON_LINES = ("pause", "resume")


class ActionRefused(BrokerError):
    """An operator action that cannot be taken; the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Action(BaseModel):
    """What an operator asks for (the console's POST body)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    action: Verb
    target: str = Field(min_length=1, max_length=200)
    note: str = Field("", max_length=500)


@dataclass(frozen=True, slots=True)
class Hold:
    kind: HoldKind
    target: str  # a worker id (drain, cordon) or an edge id (pause)
    by: str
    at: float
    note: str = ""

    @property
    def field(self) -> str:
        return field_of(self.kind, self.target)

    def dump(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def field_of(kind: HoldKind, target: str) -> str:
    return f"{'line' if kind == 'pause' else 'worker'}:{target}"


def parse_holds(raw: Mapping[bytes | str, bytes | str]) -> dict[str, Hold]:
    """The Redis hash, read; an entry that cannot be read is skipped (logged by the caller
    as the difference between the hash and what came back)."""
    out: dict[str, Hold] = {}
    for value in raw.values():
        try:
            data = json.loads(value)
            hold = Hold(**data)
        except (TypeError, ValueError):
            continue
        out[hold.field] = hold
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an action changes: the hold set or lifted, and what the audit log keeps."""

    put: Hold | None
    lift: str | None  # a hold's field to remove
    record: dict[str, Any]


def act(
    action: Action,
    *,
    by: str,
    now: float,
    holds: Mapping[str, Hold],
    workers: Collection[str],
    edges: Collection[str],
) -> Outcome:
    """The change ``action`` makes, or :class:`ActionRefused`. ``workers`` and ``edges``:
    the node ids the policy in force lists. (``release`` is not a hold: the console takes
    it to the dead letter itself.)"""
    verb, target = action.action, action.target
    record: dict[str, Any] = {"action": verb, "target": target, "by": by, "note": action.note}
    if verb in ON_WORKERS and target not in workers:
        raise ActionRefused(404, f"{verb}: no worker {target!r} in the policy in force")
    if verb in ON_LINES and target not in edges:
        raise ActionRefused(404, f"{verb}: no line PC (edge) {target!r} in the policy in force")
    if verb in ("drain", "cordon"):
        held = holds.get(field_of(verb, target))
        if held is not None and held.kind == verb:
            raise ActionRefused(409, f"{verb}: worker {target!r} is already {verb}ed by {held.by}")
        hold = Hold(verb, target, by, now, action.note)
        return Outcome(hold, None, record)
    if verb == "pause":
        if field_of("pause", target) in holds:
            raise ActionRefused(409, f"pause: offload from {target!r} is already paused")
        return Outcome(Hold("pause", target, by, now, action.note), None, record)
    if verb in ("uncordon", "resume"):
        kind: HoldKind = "cordon" if verb == "uncordon" else "pause"
        field = field_of(kind, target)
        if field not in holds:
            what = "drained or cordoned" if verb == "uncordon" else "paused"
            raise ActionRefused(409, f"{verb}: {target!r} is not {what}")
        return Outcome(None, field, {**record, "lifted": holds[field].kind})
    raise ActionRefused(400, f"{verb}: not an action")  # unreachable: Verb is closed


def cordoned(holds: Mapping[str, Hold]) -> set[str]:
    return {h.target for h in holds.values() if h.kind in ("drain", "cordon")}


def paused(holds: Mapping[str, Hold]) -> dict[str, Hold]:
    return {h.target: h for h in holds.values() if h.kind == "pause"}
