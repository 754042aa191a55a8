"""``sluicegate twin run``: a trace replayed as recorded and under a change, side by side.

Reads what the engineer hands over, each refused with a message naming the file and the
problem: a candidate policy (TOML, as the compliance officer would sign it), placement
parameters (TOML, the fields of ``broker.core.params.PlacementParams``), a fleet change
(TOML: ``remove = [...]``, ``[degrade]`` worker = factor, ``[[add]]`` workers as the trace
header writes them), a burst factor and failures (``worker@seconds``). Then replays the
baseline and the candidate with one seed, prints the comparison (and, asked, every
placement strategy on the trace), and writes ``report.json`` and the plots into a folder.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from broker.core.learned import inline
from broker.core.params import PlacementParams
from broker.errors import InvalidParams
from policies.errors import PolicyError
from policies.loader import load_policy
from policies.verdict import Moved, describe
from sluicegate.errors import SluicegateError
from sluicegate.twin import trace as tr
from sluicegate.twin.nodes import STRATEGIES, Change, PeerSpec, Result, Strategy
from sluicegate.twin.report import Comparison, compare, render, strategy_table
from sluicegate.twin.sim import replay

MOVES_SHOWN = 5  # the largest moves the text names
FAIL = re.compile(r"^(?P<worker>[A-Za-z0-9][A-Za-z0-9._-]*)@(?P<at>[0-9]+(\.[0-9]+)?)$")
CUT = re.compile(
    r"^(?P<peer>[A-Za-z0-9][A-Za-z0-9._-]*)@(?P<at>[0-9]+(\.[0-9]+)?)\+(?P<down>[0-9]+(\.[0-9]+)?)$"
)


class ChangeError(SluicegateError):
    """A change handed to the twin cannot be read."""


def _toml(path: Path, what: str) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise ChangeError(f"{what} {path}: cannot be read ({exc.strerror})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ChangeError(f"{what} {path}: not valid TOML ({exc})") from exc


def read_params(path: Path) -> PlacementParams:
    data = _toml(path, "placement parameters")
    try:
        return PlacementParams.from_mapping(inline(data, path.parent))
    except InvalidParams as exc:
        raise ChangeError(f"placement parameters {path}: {exc}") from exc


def read_fleet(path: Path) -> dict[str, Any]:
    """``{"add": (WorkerSpec, ...), "remove": (...), "degrade": ((id, factor), ...)}``."""
    data = _toml(path, "fleet change")
    unknown = sorted(set(data) - {"add", "remove", "degrade"})
    if unknown:
        raise ChangeError(
            f"fleet change {path}: unknown {', '.join(unknown)}; known: add, remove, degrade"
        )
    try:
        add = tuple(tr.WorkerSpec.model_validate(w) for w in data.get("add", []))
    except ValidationError as exc:
        raise ChangeError(
            f"fleet change {path}: a worker to add: {exc.errors()[0]['msg']}"
        ) from exc
    degrade = data.get("degrade", {})
    if not all(isinstance(f, int | float) and f > 0 for f in degrade.values()):
        raise ChangeError(
            f"fleet change {path}: [degrade] factors are numbers > 0 (2.0: half as fast)"
        )
    return {
        "add": add,
        "remove": tuple(str(w) for w in data.get("remove", [])),
        "degrade": tuple((str(k), float(v)) for k, v in sorted(degrade.items())),
    }


class PeerFile(BaseModel):
    """A sister campus to rehearse with (``--peer FILE``): its policy (its ``[peers]`` entry
    for this campus is its half), the workers it would lend (tables as a trace header
    writes them, or the workers of a trace it recorded), the link, and, from its trace,
    its broker's placement parameters."""

    model_config = ConfigDict(extra="forbid", strict=True)

    policy: str | None = None
    trace: str | None = None
    rtt_ms: float = Field(gt=0.0, le=10_000.0)
    mb_per_s: float = Field(gt=0.0, le=100_000.0)
    workers: list[dict[str, Any]] = []


def read_peer(path: Path) -> PeerSpec:
    """A ``--peer`` file, its relative paths read from beside it."""
    data = _toml(path, "sister campus")
    try:
        doc = PeerFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ChangeError(f"sister campus {path}: {where}: {first['msg']}") from exc
    header = None
    if doc.trace is not None:
        try:
            header = tr.read(path.parent / doc.trace)[0].header
        except SluicegateError as exc:
            raise ChangeError(f"sister campus {path}: its trace: {exc}") from exc
    if doc.policy is not None:
        try:
            policy = load_policy(path.parent / doc.policy)
        except PolicyError as exc:
            raise ChangeError(f"sister campus {path}: its policy: {exc}") from exc
    elif header is not None:
        policy = tr.policy_of(header)
    else:
        raise ChangeError(f"sister campus {path}: name its policy (policy = FILE) or a trace")
    for w in doc.workers:  # a list of the models it holds, where no trace gave their files
        if isinstance(w.get("models"), list):
            w["models"] = dict.fromkeys(w["models"])
    try:
        workers = tuple(tr.WorkerSpec.model_validate(w) for w in doc.workers)
    except ValidationError as exc:
        raise ChangeError(f"sister campus {path}: a worker: {exc.errors()[0]['msg']}") from exc
    if not workers and header is not None:
        workers = tuple(header.workers)
    if not workers:
        raise ChangeError(f"sister campus {path}: list the workers it lends ([[workers]])")
    params = PlacementParams()
    if header is not None and header.params:
        params = PlacementParams.from_mapping(header.params)
    return PeerSpec(policy, workers, doc.rtt_ms / 1000.0, doc.mb_per_s * 1e6, params)


def read_fail(texts: list[str]) -> tuple[tuple[str, float], ...]:
    out = []
    for text in texts:
        m = FAIL.match(text)
        if m is None:
            raise ChangeError(f"--fail {text!r}: give worker@seconds, e.g. north-cpu-1@120")
        out.append((m["worker"], float(m["at"])))
    return tuple(out)


def read_cuts(
    texts: list[str], peers: tuple[PeerSpec, ...]
) -> tuple[tuple[str, float, float], ...]:
    """``--cut PEER@S+D``: the link to sister campus PEER down S seconds into the trace, for
    D seconds."""
    described = {p.campus for p in peers}
    out = []
    for text in texts:
        m = CUT.match(text)
        if m is None or float(m["down"]) <= 0:
            raise ChangeError(f"--cut {text!r}: give campus@seconds+seconds, e.g. fab-south@120+30")
        if m["peer"] not in described:
            named = ", ".join(sorted(described)) or "none (give --peer FILE)"
            raise ChangeError(f"--cut {text!r}: no sister campus {m['peer']!r}; described: {named}")
        out.append((m["peer"], float(m["at"]), float(m["down"])))
    return tuple(out)


def build_change(
    *,
    policy: Path | None,
    params: Path | None,
    fleet: Path | None,
    burst: int,
    fail: list[str],
    strategy: str,
    peers: list[Path] | None = None,
    cuts: list[str] | None = None,
) -> Change:
    if strategy not in STRATEGIES:
        raise ChangeError(f"--strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if burst < 1:
        raise ChangeError(f"--burst {burst}: a factor of 1 or more (2, 5, 10)")
    try:
        candidate = load_policy(policy) if policy is not None else None
    except PolicyError as exc:
        raise ChangeError(f"candidate policy: {exc}") from exc
    fleet_change = read_fleet(fleet) if fleet is not None else {}
    sisters = tuple(read_peer(p) for p in peers or [])
    campuses = [s.campus for s in sisters]
    if len(set(campuses)) < len(campuses):
        raise ChangeError(f"--peer: one file per sister campus ({', '.join(sorted(campuses))})")
    chosen: Strategy = next(s for s in STRATEGIES if s == strategy)
    return Change(
        policy=candidate,
        params=read_params(params) if params is not None else None,
        burst=burst,
        fail=read_fail(fail),
        strategy=chosen,
        peers=sisters,
        cuts=read_cuts(cuts or [], sisters),
        **fleet_change,
    )


@dataclass(frozen=True)
class Rehearsal:
    """A trace replayed as recorded (``baseline``) and under the change (``candidate``);
    ``judged``: the candidate beside the policy in force replayed under the same
    conditions (the same burst, losses and fleet changes), which a verdict judges."""

    trace: tr.Trace
    trace_digest: str
    baseline: Result
    candidate: Result
    comparison: Comparison
    judged: Comparison
    text: str


def rehearse(
    trace_path: Path, change: Change, *, seed: int = 0, strategies: bool = False
) -> Rehearsal:
    trace, digest = tr.read(trace_path)
    named = {w for w, _ in change.fail} | set(change.remove) | {w for w, _ in change.degrade}
    have = {w.id for w in trace.header.workers} | {w.id for w in change.add}
    unknown = sorted(named - have)
    if unknown:
        raise ChangeError(
            f"the trace has no worker {', '.join(unknown)}; it has "
            + ", ".join(w.id for w in trace.header.workers)
        )
    world = Change(peers=change.peers)  # sister campuses are there in every replay
    baseline = replay(trace, world, seed=seed)
    candidate = replay(trace, change, seed=seed)
    comparison = compare(baseline, candidate)
    conditions = replace(change, policy=None, params=None, strategy="ours")
    in_force = baseline if conditions == world else replay(trace, conditions, seed=seed)
    judged = comparison if in_force is baseline else compare(in_force, candidate)
    lines = [
        f"trace {trace_path} (sha256 {digest[:16]}…, {len(trace.jobs)} jobs, "
        f"{trace.duration_s:.0f} s, {trace.header.source}); seed {seed}",
        render(comparison),
    ]
    moves = comparison.moves[:MOVES_SHOWN]
    if moves:
        lines.append("largest moves:")
        lines += [f"  {describe(Moved(**m._asdict()))}" for m in moves]
    if judged is not comparison and judged.baseline != judged.candidate:
        # The conditions moved the baseline too: what the candidate itself changes.
        lines += [
            "",
            "under the same conditions, the policy in force beside the candidate:",
            render(judged, ("in force", "candidate")),
        ]
    lines += [f"warning: {w}" for w in candidate.warnings]
    if strategies:
        runs: dict[str, Result] = {
            s: replay(trace, Change(strategy=s), seed=seed) for s in STRATEGIES
        }
        lines += ["", "placement strategies on the trace as recorded:", strategy_table(runs)]
    return Rehearsal(trace, digest, baseline, candidate, comparison, judged, "\n".join(lines))


def write_report(rehearsal: Rehearsal, folder: Path, *, plots: bool = True) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / "report.json"
    data = json.loads(rehearsal.comparison.to_json())
    data["trace_sha256"] = rehearsal.trace_digest
    report.write_text(json.dumps(data, sort_keys=True, indent=2) + "\n")
    written = [report]
    if plots:
        from sluicegate.twin.plots import write_plots

        written += write_plots(rehearsal.baseline, rehearsal.candidate, folder)
    return written
