"""``sluicegate doctor``'s order of checks: gather each fact, judge it, in the order a
person would fix things (the configuration, the identity, the network, TLS, time, the
policy, the models, the disk, Mosquitto itself).

A check whose preconditions failed is skipped with the reason, not run into a confusing
second error. What the checks mean and how to fix each is in docs/deployment.md.
"""

from __future__ import annotations

import asyncio
import os
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from policies.keys import public_key_of
from sluicegate.config import Settings, load_settings
from sluicegate.deploy.layout import ROLES, Role
from sluicegate.doctor import gather, judge, judge_node
from sluicegate.doctor.facts import Connect, Finding, PolicyState, RoundTrip, Running, skip
from sluicegate.errors import ConfigError
from sluicegate.identity import certificate_name
from sluicegate.policy_standing import standing


@dataclass(frozen=True)
class Report:
    """Every finding in order, and the measurements a reader may want beside them."""

    findings: tuple[Finding, ...]
    connect: Connect | None = None
    round_trip: RoundTrip | None = None

    @property
    def failed(self) -> bool:
        return any(f.status == "FAIL" for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def text(self) -> str:
        return "\n".join(line for f in self.findings for line in f.lines()) + "\n"

    def finding(self, what: str) -> Finding:
        """The first finding whose subject starts with ``what``."""
        for f in self.findings:
            if f.what.startswith(what):
                return f
        raise KeyError(what)


@dataclass(frozen=True)
class Node:
    """Where one role keeps what doctor checks."""

    id: str
    state_dir: Path | None  # the node's own folder: policy files, enrollment record
    data_dir: Path | None  # what must be writable: an edge's outbox folder
    data_setting: str
    lock_dir: Path | None
    policy_file: Path | None
    policy_setting: str
    uses_policy: bool
    models_dir: Path | None
    models_setting: str
    zone: str | None = None  # where its configuration puts it (an edge, a pool worker)
    key_file: Path | None = None  # its own key, the one its policy entry should list


def node_of(settings: Settings, role: Role) -> Node:
    from sluicegate.vision.runtime import default_models_dir

    if role == "edge":
        from edge_agent.service import follows_policy, outbox_path

        edge, offload = settings.edge, settings.offload
        outbox = outbox_path(settings).parent
        setting = "[edge] outbox_path" if edge.outbox_path else "[offload] state_dir"
        return Node(
            id=edge.id,
            state_dir=offload.state_dir,
            data_dir=outbox,
            data_setting=setting,
            lock_dir=outbox,
            policy_file=offload.policy_file,
            policy_setting="[offload] policy_file",
            # As the agent: it follows any policy it is given, offload on or off.
            uses_policy=follows_policy(offload),
            models_dir=edge.models_dir or default_models_dir(),
            models_setting="[edge] models_dir",
            zone=edge.zone,
            key_file=edge.key_file,
        )
    if role == "pool":
        pool = settings.pool
        return Node(
            id=pool.id,
            state_dir=pool.state_dir,
            data_dir=pool.state_dir,
            data_setting="[pool] state_dir",
            lock_dir=pool.state_dir,
            policy_file=pool.policy_file,
            policy_setting="[pool] policy_file",
            uses_policy=True,
            models_dir=pool.models_dir or default_models_dir(),
            models_setting="[pool] models_dir",
            zone=pool.zone,
            key_file=pool.key_file,
        )
    broker = settings.broker
    return Node(  # a replica holds a lease in Redis, not a lock file
        id=broker.id,
        state_dir=broker.state_dir,
        data_dir=broker.state_dir,
        data_setting="[broker] state_dir",
        lock_dir=None,
        policy_file=broker.policy_file,
        policy_setting="[broker] policy_file",
        uses_policy=True,
        models_dir=None,
        models_setting="[broker] models_dir",
    )


def infer_role(config: Path | None) -> Role | None:
    """The role a config file is for, from its sections (None: not one role's)."""
    if config is None:
        return None
    try:
        with config.open("rb") as handle:
            sections = set(tomllib.load(handle))
    except (OSError, tomllib.TOMLDecodeError):
        return None
    found = [r for r in ROLES if r in sections or (r == "edge" and "offload" in sections)]
    return found[0] if len(found) == 1 else None


def diagnose(
    config: Path | None,
    role: Role,
    *,
    broker_url: str | None = None,
    clock: Callable[[], float] = time.time,
) -> Report:
    """Run every check for the ``role`` node configured by ``config`` (None: defaults and
    the environment)."""
    source = str(config) if config is not None else "defaults and environment"
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        return Report((judge.judge_config(source, str(exc), role, "?"),))
    node = node_of(settings, role)
    mqtt = settings.mqtt
    out = [judge.judge_config(source, None, role, node.id)]
    try:
        cert_name, cert_error = certificate_name(mqtt), None
    except ConfigError as exc:
        cert_name, cert_error = None, str(exc)
    out.append(judge.judge_identity(mqtt, node.id, role, cert_name, cert_error))
    connect = gather.tcp_connect(mqtt.host, mqtt.port)
    out.append(judge.judge_reachable(connect))
    out += _tls(settings, role, connect, clock())
    policy = None
    if node.uses_policy:
        policy = gather.policy_state(node.id, node.policy_file, node.state_dir, now=clock())
    out.append(_clock(settings, node, broker_url, policy, clock))
    if policy is not None:
        found = None
        if policy.policy is not None:
            key = public_key_of(node.key_file)
            found = standing(policy.policy, role, node.id, node.zone, key)
        out.append(
            judge_node.judge_policy(policy, role, node.policy_setting, now=clock(), found=found)
        )
    else:
        out.append(skip("policy", "none given (offload off, no policy_file, no pinned anchor)"))
    if node.models_dir is not None:
        out.append(judge_node.judge_models(gather.models(node.models_dir, node.models_setting)))
    else:
        out.append(skip("models", "a broker runs no model"))
    if node.data_dir is not None:
        out.append(judge_node.judge_state_dir(gather.state_dir(node.data_dir, node.data_setting)))
    else:
        out.append(skip("state dir", f"no {node.data_setting}: this node keeps nothing on disk"))
    trip = None
    blocked = _login_blocked(out, settings, role, node)
    if blocked is not None:
        out.append(blocked)
    else:
        login = judge_node.login_for(mqtt, role, node.id, str(os.getpid()))
        from sluicegate.doctor.probe import round_trips

        trip = asyncio.run(round_trips(mqtt, node.id, login))
        out.append(judge_node.judge_round_trip(trip, connect.best_ms))
    return Report(tuple(out), connect, trip)


def _tls(settings: Settings, role: Role, connect: Connect, now: float) -> list[Finding]:
    mqtt = settings.mqtt
    if mqtt.tls_ca_file is None:
        why = "no [mqtt] tls_ca_file is set"
        return [skip("CA file", why), skip("node certificate", why), skip("TLS", why)]
    files = gather.tls_files(mqtt)
    out = [judge.judge_ca(files), judge.judge_node_cert(files, role, now=now)]
    what = f"TLS to {mqtt.host}:{mqtt.port}"
    if connect.error is not None:
        out.append(skip(what, "the MQTT broker is not reachable"))
    elif files.ca is None:
        out.append(skip(what, "the CA file did not load"))
    elif files.cert_error is not None or files.key_error is not None:
        out.append(skip(what, "the node's certificate or key did not load"))
    else:
        shake = gather.handshake(mqtt)
        out.append(judge.judge_server_tls(shake, files, mqtt.host, mqtt.port, role))
    return out


def _clock(
    settings: Settings,
    node: Node,
    broker_url: str | None,
    policy: PolicyState | None,
    clock: Callable[[], float],
) -> Finding:
    from sluicegate.enroll.client import RECORD

    url = broker_url or gather.enrolled_broker_url(node.state_dir, RECORD)
    if url is None:
        where = f" in {node.state_dir}" if node.state_dir is not None else ""
        return skip("clock", f"no --broker-url given and no {RECORD}{where} names the broker")
    pinned = None
    if policy is not None and policy.anchor is not None and policy.policy is not None:
        pinned = policy.policy.max_skew_s
    fact = gather.broker_clock(url, settings.mqtt.tls_ca_file, clock)
    return judge.judge_clock(fact, pinned)


def _login_blocked(
    findings: list[Finding], settings: Settings, role: Role, node: Node
) -> Finding | None:
    """Why the MQTT login must not happen, or None when it may."""
    what = "MQTT round trip"
    for f in findings:
        if f.status == "FAIL" and (
            f.what == "identity"
            or f.what.startswith(("MQTT broker", "CA file", "node certificate", "TLS"))
        ):
            return skip(what, f"needs the checks above to pass ({f.what} failed)")
    if role == "broker":
        running = gather.broker_running(settings.broker.redis_url, node.id)
    elif node.lock_dir is None:
        running = Running(None, f"no {node.data_setting}, so no lock file")
    else:
        running = gather.node_running(node.lock_dir, node.id)
    return judge_node.login_skip(running, node.id)
