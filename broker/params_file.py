"""The placement parameters a broker runs with, and the rollout gate they pass.

Without ``[broker] placement_file`` the parameters come from the broker's settings
(``PlacementParams.from_settings``). With it, they are that TOML file's: the fields of
``broker.core.params.PlacementParams`` (link latency and bandwidth per link class, the
campus prefix, staleness, explanation depth, and ``[learned]``: a learned placement policy's
file and its pinned sha256, ``broker.core.learned.inline``), each field left out at its
default: the file
``sluicegate twin run --params`` rehearses, so the digest a verdict binds is the digest of
what the broker runs. Its verdict, if any, lies beside it as ``<file>.verdict`` (what
``sluicegate twin verdict --params FILE --out FILE.verdict`` writes).

When the policy in force requires verdicts (its ``[rollout]`` table), a parameter set other
than the one this broker last accepted (at first: the one its settings give) needs a
passing verdict for its digest, by a twin key
of that policy, at thresholds at least as strict (``policies.verdict.require_verdict``). The
accepted set is kept in ``state_dir`` (``placement-accepted.json``): a restart keeps it
without asking again, and a refused candidate leaves the broker on the set it accepted
before (on the first start, its settings' defaults), the refusal named for the log and the
audit. A file that cannot be read or holds an unknown field or a value out of range is a
configuration error: the broker does not start on it.

A candidate can also run in shadow (:func:`shadow_of`: ``shadow_policy_file``,
``shadow_placement_file``): it decides every request beside production, on live traffic,
and is compared with it (``broker.core.shadow``); nothing it decides is acted on.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from broker.core.learned import inline
from broker.core.params import FleetParams, PlacementParams
from broker.core.shadow import Shadow
from broker.errors import InvalidParams
from policies.errors import PolicyError
from policies.loader import load_policy
from policies.model import Policy
from policies.verdict import Candidate, Verdict, read_verdict, require_verdict
from sluicegate.config import BrokerSettings
from sluicegate.errors import ConfigError
from sluicegate.files import write_atomic
from sluicegate.vision.manifest import Requirements

ACCEPTED_FILE = "placement-accepted.json"


@dataclass(frozen=True, slots=True)
class ParamsRefused:
    """A candidate parameter set not activated: the refusal's code and its words."""

    digest: str
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class ParamsChoice:
    """The parameters to run with, where they came from, and a refused candidate if any."""

    params: PlacementParams
    source: str  # "settings", the placement file, or "accepted earlier"
    refused: ParamsRefused | None = None


def verdict_path(path: Path) -> Path:
    return path.with_name(path.name + ".verdict")


def read_placement_file(path: Path) -> PlacementParams:
    """The parameters in ``path``; :class:`ConfigError` naming the file and the problem."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"placement file {path}: cannot be read ({exc.strerror})") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"placement file {path}: not valid TOML ({exc})") from exc
    try:
        return PlacementParams.from_mapping(inline(data, path.parent))
    except InvalidParams as exc:
        raise ConfigError(f"placement file {path}: {exc}") from exc


def _verdict(path: Path) -> Verdict | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"verdict {path}: cannot be read ({exc.strerror})") from exc
    return read_verdict(data, source=str(path))


def _accepted(state_dir: Path | None) -> PlacementParams | None:
    if state_dir is None:
        return None
    path = state_dir / ACCEPTED_FILE
    try:
        doc = json.loads(path.read_text())
        params = PlacementParams.from_mapping(doc["params"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, InvalidParams) as exc:
        raise ConfigError(
            f"{path}: the placement parameters this broker accepted cannot be read ({exc}); "
            "restore the file, or remove it to start again from the settings"
        ) from exc
    if doc.get("digest") != params.digest():
        raise ConfigError(f"{path}: its digest does not match its parameters (edited by hand?)")
    return params


def _keep(state_dir: Path | None, params: PlacementParams) -> None:
    if state_dir is not None:
        doc = {"digest": params.digest(), "params": params.describe()}
        state_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(state_dir / ACCEPTED_FILE, json.dumps(doc, indent=2).encode())


def choose_params(settings: BrokerSettings, policy: Policy | None) -> ParamsChoice:
    """The parameters this broker runs with under ``policy`` (the one in force); persists a
    newly accepted set. See the module docstring."""
    path = settings.placement_file
    if path is None:
        candidate, source = PlacementParams.from_settings(settings), "settings"
    else:
        candidate, source = read_placement_file(path), str(path)
    accepted = _accepted(settings.state_dir)
    held = accepted or PlacementParams.from_settings(settings)
    digest = candidate.digest()
    if held.digest() != digest:
        try:
            verdict = _verdict(verdict_path(path)) if path is not None else None
            gate = policy.rollout if policy is not None else None
            require_verdict(gate, verdict, Candidate(kind="params", digest=digest))
        except PolicyError as exc:
            where = "accepted earlier" if accepted is not None else "settings"
            return ParamsChoice(held, where, ParamsRefused(digest, exc.reason, str(exc)))
    if accepted is None or accepted.digest() != digest:
        _keep(settings.state_dir, candidate)
    return ParamsChoice(candidate, source)


def shadow_of(
    settings: BrokerSettings, requirements: Mapping[str, Requirements] | None = None
) -> Shadow | None:
    """The shadow candidate the settings name (``shadow_policy_file``, a policy TOML that
    need not be signed since it never acts; ``shadow_placement_file``, parameters read as
    :func:`read_placement_file` reads them), or None. :class:`ConfigError` names a file that
    cannot be used."""
    policy_path, params_path = settings.shadow_policy_file, settings.shadow_placement_file
    if policy_path is None and params_path is None:
        return None
    policy = None
    if policy_path is not None:
        try:
            policy = load_policy(policy_path)
        except PolicyError as exc:
            raise ConfigError(f"shadow policy {policy_path}: {exc}") from exc
    params = (
        read_placement_file(params_path)
        if params_path is not None
        else PlacementParams.from_settings(settings)
    )
    parts = [f"policy v{policy.version} ({policy_path})" if policy else "the policy in force"]
    parts.append(f"parameters {params.digest()[:16]} ({params_path or 'settings'})")
    return Shadow(
        policy=policy,
        params=params,
        fleet_params=FleetParams.from_settings(settings),
        requirements=requirements,
        label=", ".join(parts),
    )
