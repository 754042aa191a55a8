"""Twin verdicts: a rehearsal's outcome, signed, bound to the change it judged.

A platform engineer rehearses a candidate (a policy version, or a set of placement
parameters) on a recorded trace in the digital twin; the twin's figures are judged here
against thresholds (:func:`judge`: minimum deadline attainment, the most jobs any node may
hold, no placement the candidate's own policy forbids, and no job of a class the policy in
force keeps on campus placed off site) and the verdict is signed with a twin key
(:func:`sign_verdict`). It binds the candidate's digest, the trace's digest, the thresholds
and the figures: a verdict cannot be moved to another change.

A policy's ``[rollout]`` table lists the twin keys it trusts and the thresholds a change
must have passed; :func:`check_verdict` is what the broker and the nodes run before they
accept the next version under such a policy (:func:`require_verdict`, also for a broker's
next placement parameters), raising the :class:`VerdictRefused` subclass that says why.
Pure: no clock (``issued_at`` is given), no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies.canonical import canonical_json
from policies.errors import (
    PolicyParseError,
    VerdictBadSignature,
    VerdictFailed,
    VerdictMissing,
    VerdictOtherCandidate,
    VerdictUnknownSigner,
    VerdictWeakConditions,
    VerdictWeakThresholds,
)
from policies.keys import SigningKey, b64u_decode, b64u_encode, signature_valid
from policies.model import Rollout

FORMAT: Literal["sluicegate-verdict/1"] = "sluicegate-verdict/1"
DOMAIN = b"sluicegate-verdict-signature/1\n"
Kind = Literal["policy", "params"]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Thresholds(_Doc):
    """What a rehearsal must show for its candidate to pass."""

    min_attainment: float = Field(0.95, ge=0.0, le=1.0)
    max_queue_depth: int = Field(64, ge=0)  # jobs any one node holds at its peak
    # How many points of deadline attainment the candidate may lose against the policy in
    # force replayed on the same trace, overall, per line and per data class (None: the
    # verdict judges no difference: one signed before it could).
    max_drop_points: float | None = Field(None, ge=0.0, le=100.0)

    def weaker_than(self, required: Thresholds) -> list[str]:
        """Where these thresholds ask less than ``required`` does."""
        out = []
        need = required.max_drop_points
        if need is not None and (self.max_drop_points is None or self.max_drop_points > need):
            have = "none" if self.max_drop_points is None else f"{self.max_drop_points:g}"
            out.append(f"max_drop_points {have} > required {need:g}")
        if self.min_attainment < required.min_attainment:
            out.append(
                f"min_attainment {self.min_attainment:g} < required {required.min_attainment:g}"
            )
        if self.max_queue_depth > required.max_queue_depth:
            out.append(
                f"max_queue_depth {self.max_queue_depth} > required {required.max_queue_depth}"
            )
        return out


class InForce(_Doc):
    """The policy in force replayed on the same trace, under the same conditions: what the
    candidate is measured against."""

    attainment: float = Field(ge=0.0, le=1.0)
    by_line: dict[str, float]  # edge -> deadline attainment of its jobs
    by_class: dict[str, float]  # data class -> deadline attainment
    peak_queue_depth: dict[str, int]


class Moved(_Doc):
    """Jobs of one class from one line that ran elsewhere under the candidate."""

    data_class: str
    line: str
    before: str | None  # the node that ran them under the policy in force (None: none)
    after: str | None  # ... and under the candidate
    jobs: int = Field(ge=1)


class Figures(_Doc):
    """What the twin measured for the candidate."""

    attainment: float = Field(ge=0.0, le=1.0)
    peak_queue_depth: dict[str, int]  # node -> jobs held at its peak
    violations: int = Field(ge=0)  # placements the candidate's own policy forbids
    # data class -> zone -> jobs placed there although the policy in force keeps it on campus
    left_campus: dict[str, dict[str, int]] = Field(default_factory=dict)
    # Beside the policy in force (None in a verdict signed before it was judged so):
    by_line: dict[str, float] | None = None
    by_class: dict[str, float] | None = None
    in_force: InForce | None = None
    moved: list[Moved] | None = None  # the largest moves first


class Candidate(_Doc):
    kind: Kind
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")  # sha256 of the candidate, hex
    version: int | None = None  # a policy's version


class Body(_Doc):
    """Everything a verdict says; the signature covers its canonical JSON."""

    format: Literal["sluicegate-verdict/1"] = FORMAT
    candidate: Candidate
    trace_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    thresholds: Thresholds
    figures: Figures
    passed: bool
    reasons: list[str]  # why it failed, one sentence each; empty when it passed
    issued_at: float
    # What else the rehearsal assumed (a burst factor, workers lost or changed), in words.
    conditions: dict[str, str] = Field(default_factory=dict)
    # The factor the recorded arrivals were multiplied by (None: as recorded); a gate may
    # require at least one (``Rollout.min_burst``).
    burst: float | None = Field(None, ge=1.0)


class Verdict(_Doc):
    body: Body
    key_id: str = Field(min_length=1, max_length=64)
    public: str  # ed25519 public key, base64url (for the message; trust is by the policy)
    signature: str

    def to_bytes(self) -> bytes:
        return canonical_json(self.model_dump(mode="json"))


def judge(figures: Figures, thresholds: Thresholds) -> tuple[bool, list[str]]:
    """(passed, why not): each failed threshold named with its figure and, beside the policy
    in force, what the candidate moved. A floor of the ``[rollout]`` that the policy in force
    itself misses on the trace is judged against the policy in force instead: a loaded trace
    judges the change, not the campus."""
    base, margin = figures.in_force, thresholds.max_drop_points
    reasons = []
    floor, why = thresholds.min_attainment, f"the minimum {thresholds.min_attainment:g}"
    if base is not None and margin is not None and base.attainment < floor:
        floor = base.attainment - margin / 100.0
        why = (
            f"{base.attainment:.4f} for the policy in force less the {margin:g}-point margin "
            f"(the policy in force itself misses the minimum {thresholds.min_attainment:g} "
            "on this trace)"
        )
    if figures.attainment < floor - 1e-9:
        reasons.append(f"deadline attainment {figures.attainment:.4f} is below {why}")
    if base is not None and margin is not None:
        reasons += _drops("line", base.by_line, figures.by_line or {}, margin, figures.moved)
        reasons += _drops("class", base.by_class, figures.by_class or {}, margin, figures.moved)
    for node, depth in sorted(figures.peak_queue_depth.items()):
        allowed = thresholds.max_queue_depth
        before = base.peak_queue_depth.get(node) if base is not None else None
        if before is not None and before > allowed:
            allowed = before  # the policy in force holds as much there already
        if depth > allowed:
            was = f" ({before} under the policy in force)" if before is not None else ""
            reasons.append(
                f"{node} would hold {depth} jobs at its peak, more than the {allowed} "
                f"allowed{was}{_arrived(figures.moved, node)}"
            )
    if figures.violations:
        reasons.append(
            f"{figures.violations} placements break the candidate's own policy (a fault in "
            "the placement code: never expected)"
        )
    for data_class, zones in sorted(figures.left_campus.items()):
        for zone, jobs in sorted(zones.items()):
            reasons.append(
                f"{jobs} {data_class} jobs would run in {zone}, off site, where the policy in "
                f"force keeps {data_class} on campus"
            )
    return not reasons, reasons


def _drops(
    kind: Literal["line", "class"],
    before: Mapping[str, float],
    after: Mapping[str, float],
    margin: float,
    moved: list[Moved] | None,
) -> list[str]:
    """A reason for each line (or class) whose attainment falls by more than ``margin``
    points, with what moved of its jobs."""
    out = []
    for key, was in sorted(before.items()):
        now = after.get(key, 0.0)
        if (was - now) * 100.0 > margin + 1e-9:
            of = [m for m in moved or () if (m.line if kind == "line" else m.data_class) == key]
            went = "; " + ", ".join(map(describe, of[:3])) if of else ""
            out.append(
                f"{kind} {key}: deadline attainment falls from {was:.4f} under the policy in "
                f"force to {now:.4f}, more than the {margin:g}-point margin{went}"
            )
    return out


def _arrived(moved: list[Moved] | None, node: str) -> str:
    """What the candidate moved onto ``node``, in words ("" when nothing)."""
    onto = [m for m in moved or () if m.after == node]
    return "; " + ", ".join(map(describe, onto[:3])) if onto else ""


def describe(m: Moved) -> str:
    """What a move is, in words."""
    now = f"now wait on {m.after}" if m.after is not None else "now end unrun"
    was = f"they ran on {m.before}" if m.before is not None else "they ended unrun before"
    return f"{m.jobs} {m.data_class} jobs from {m.line} {now} ({was})"


def _message(body: Body) -> bytes:
    # A body without a burst, a margin or the figures beside the policy in force signs as
    # it did before those fields existed.
    exclude: dict[str, Any] = {}
    if body.burst is None:
        exclude["burst"] = True
    if body.thresholds.max_drop_points is None:
        exclude["thresholds"] = {"max_drop_points"}
    absent = {
        k for k in ("by_line", "by_class", "in_force", "moved") if getattr(body.figures, k) is None
    }
    if absent:
        exclude["figures"] = absent
    return DOMAIN + canonical_json(body.model_dump(mode="json", exclude=exclude or None))


def sign_verdict(body: Body, key: SigningKey, key_id: str) -> Verdict:
    return Verdict(
        body=body,
        key_id=key_id,
        public=b64u_encode(key.public),
        signature=b64u_encode(key.sign(_message(body))),
    )


def read_verdict(data: bytes, *, source: str = "<verdict>") -> Verdict:
    try:
        return Verdict.model_validate(json.loads(data))
    except (ValueError, ValidationError) as exc:
        first = str(exc).splitlines()[:2]
        raise PolicyParseError(
            f"not a {FORMAT} document: {' '.join(first)}", source=source
        ) from exc


def check_verdict(
    verdict: Verdict | None,
    *,
    trusted: Mapping[str, bytes],
    candidate: Candidate,
    required: Thresholds,
) -> None:
    """Accept ``verdict`` for ``candidate`` or raise why not. ``trusted``: the twin keys
    (key id -> public key) of the policy in force; ``required``: its thresholds."""
    what = f"{candidate.kind} {candidate.digest[:16]}…" + (
        f" (version {candidate.version})" if candidate.version is not None else ""
    )
    if verdict is None:
        raise VerdictMissing(
            f"{what} needs a passing twin verdict (the policy in force requires one): "
            "rehearse it with 'sluicegate twin run' and sign the result with "
            "'sluicegate twin verdict'"
        )
    public = trusted.get(verdict.key_id)
    try:
        claimed = b64u_decode(verdict.public)
    except ValueError:
        claimed = b""
    if public is None or public != claimed:
        raise VerdictUnknownSigner(
            f"the verdict for {what} is signed by key {verdict.key_id!r}, which is not a twin "
            f"key of the policy in force (trusted: {', '.join(sorted(trusted)) or 'none'})"
        )
    try:
        signature = b64u_decode(verdict.signature)
    except ValueError:
        signature = b""
    if not signature_valid(public, signature, _message(verdict.body)):
        raise VerdictBadSignature(
            f"the verdict for {what} does not verify under twin key {verdict.key_id!r}: it was "
            "changed after it was signed"
        )
    body = verdict.body
    if body.candidate.kind != candidate.kind or body.candidate.digest != candidate.digest:
        raise VerdictOtherCandidate(
            f"the verdict judged {body.candidate.kind} {body.candidate.digest[:16]}…, not "
            f"{what}: rehearse this change itself"
        )
    weaker = body.thresholds.weaker_than(required)
    if weaker:
        raise VerdictWeakThresholds(
            f"the verdict for {what} passed thresholds looser than the policy in force "
            f"requires: {'; '.join(weaker)}"
        )
    passed, reasons = judge(body.figures, body.thresholds)
    if not (passed and body.passed):
        why = "; ".join(reasons or body.reasons) or "the verdict says it failed"
        raise VerdictFailed(f"the rehearsal of {what} failed: {why}")


def require_verdict(gate: Rollout | None, verdict: Verdict | None, candidate: Candidate) -> None:
    """The gate of the policy in force (its ``[rollout]``): when it requires a verdict,
    ``verdict`` must pass :func:`check_verdict` for ``candidate`` with its twin keys and at
    its thresholds; otherwise nothing is required."""
    if gate is None or not gate.require_verdict:
        return
    check_verdict(
        verdict,
        trusted=gate.twin_keys,
        candidate=candidate,
        required=Thresholds(
            min_attainment=gate.min_attainment,
            max_queue_depth=gate.max_queue_depth,
            max_drop_points=gate.max_drop_points,
        ),
    )
    assert verdict is not None  # check_verdict refuses a missing one
    burst = verdict.body.burst or 1.0
    if burst < gate.min_burst:
        raise VerdictWeakConditions(
            f"the verdict for {candidate.kind} {candidate.digest[:16]}… was rehearsed at "
            f"{burst:g}x the recorded arrivals; the policy in force requires a rehearsal at "
            f"{gate.min_burst:g}x at least (twin verdict --burst {gate.min_burst:g})"
        )
