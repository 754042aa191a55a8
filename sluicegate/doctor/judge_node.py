"""The judgements of ``sluicegate doctor`` about the node itself: its pinned policy, models,
state folder, and its round trips through Mosquitto as itself (with the login that must
not disturb a running node or its session).

Pure, like :mod:`sluicegate.doctor.judge` (the connection's judgements): facts in, one
:class:`Finding` out with its fix; thresholds are named constants here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from sluicegate.config import MqttSettings
from sluicegate.doctor.facts import (
    Finding,
    Models,
    PolicyState,
    RoundTrip,
    Running,
    StateDir,
    Warn,
    fail,
    ok,
    skip,
)
from sluicegate.doctor.judge import date_text
from sluicegate.policy_standing import Standing

POLICY_WARN_DAYS = 7.0
DISK_WARN_BYTES = 1024**3
DISK_FAIL_BYTES = 100 * 1024**2
# Nagle's algorithm holds a small packet until the previous one is acknowledged, and the
# receiver delays that ACK by ~40 ms: 44.5 ms a round trip against 11 ms with nodelay.
NAGLE_RTT_MS = 20.0
NEAR_CONNECT_MS = 2.0
NODELAY_FIX = "set_tcp_nodelay true in mosquitto.conf (sluicegate mosquitto config writes it)"
# Refusals that mean a policy was tampered with or signed by the wrong people (every
# ``PolicyRefused`` reason but an older version offered beside a newer one).
HARMLESS_REFUSALS = frozenset({"policy.rollback"})


_POLICY_FIX = {
    "policy.no_anchor": "enroll the node ('sluicegate {role} install --join TOKEN' pins the "
    "campus's policy), or set {setting} to the signed campus policy with its .sig beside it",
    "policy.expired": "have the officers sign a newer version and install it on the broker "
    "([broker] policy_file): the broker publishes it to every node",
}
_UNTRUSTED_FIX = (
    "install the campus policy exactly as its officers signed it ({setting} with its .sig "
    "beside it, from the campus), or enroll the node again: a policy not signed by the "
    "officers the pinned anchor trusts is never used"
)


def judge_policy(
    state: PolicyState, role: str, setting: str, *, now: float, found: Standing | None = None
) -> Finding:
    """The policy the node would hold: verified against its pinned anchor, current, and no
    candidate refused for its signatures; ``found``: what it says of this node that wants
    fixing (not listed, another zone, another key), a warning."""
    what = "policy"

    def fix(code: str) -> str:
        return _POLICY_FIX.get(code, _UNTRUSTED_FIX).format(role=role, setting=setting)

    if state.error is not None:
        return fail(what, state.error, fix("policy.no_anchor"))
    untrusted = [r for r in state.refused if r not in HARMLESS_REFUSALS]
    if untrusted:
        return fail(
            what,
            f"refused [{', '.join(untrusted)}] from {state.sources}: {state.last_refusal}",
            fix(untrusted[0]),
        )
    policy, anchor = state.policy, state.anchor
    if anchor is None:
        return fail(what, f"no pinned trust anchor ({state.sources})", fix("policy.no_anchor"))
    if policy is None:
        return fail(what, f"no verified policy from {state.sources}", fix("policy.no_anchor"))
    if now >= policy.expires:
        return fail(
            what,
            f"policy v{policy.version} expired at {date_text(policy.expires)}",
            fix("policy.expired"),
        )
    warnings = [Warn(found.text, found.fix)] if found is not None else []
    days = (policy.expires - now) / 86400.0
    if days < POLICY_WARN_DAYS:
        warnings.append(
            Warn(f"policy v{policy.version} expires in {days:.1f} days", fix("policy.expired"))
        )
    if state.refused:
        warnings.append(
            Warn(
                f"{setting} is older than the policy this node holds, so it is ignored",
                f"replace {setting} with the current signed policy, or remove the setting",
            )
        )
    detail = (
        f"{policy.campus!r} v{policy.version} verified against the pinned anchor "
        f"({anchor.threshold} of {len(anchor.signer_keys)} officers), expires "
        f"{date_text(policy.expires)}"
    )
    return ok(what, detail, *warnings)


def judge_models(models: Models) -> Finding:
    what = f"models {models.folder}"
    if models.error is not None:
        return fail(
            what,
            models.error,
            f"restore the models (the install bundle's, or the package's models/ folder), or "
            f"set {models.setting} to a folder whose models match their manifests ('sluicegate "
            "models list --models-dir DIR' checks one)",
        )
    return ok(what, f"{', '.join(models.names)} verified (sha256 against their manifests)")


def _size(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:.0f} MiB"


def judge_state_dir(state: StateDir) -> Finding:
    what = f"state dir {state.path}"
    where = f"set {state.setting} to a folder the node's user can create and write"
    if state.exists and not state.is_dir:
        return fail(what, "is a file, not a folder", f"move the file away, or {where}")
    if state.blocker is not None:
        return fail(what, f"cannot be created: {state.blocker}", f"{where}, or clear the way")
    if state.write_error is not None:
        return fail(
            what,
            f"no file can be written there: {state.write_error}",
            f"give the node's user the folder (chown sluicegate: {state.path}), or {where}",
        )
    free = state.free_bytes
    if free is not None and free < DISK_FAIL_BYTES:
        return fail(
            what, f"only {_size(free)} free on its disk", f"free disk space there, or {where}"
        )
    warnings = []
    if free is not None and free < DISK_WARN_BYTES:
        warnings.append(Warn(f"only {_size(free)} free on its disk", "free disk space there"))
    room = f"{_size(free)} free" if free is not None else "free space unknown"
    said = "writable" if state.exists else "does not exist yet; the node creates it"
    return ok(what, f"{said}, {room}", *warnings)


def login_skip(running: Running, node: str) -> Finding | None:
    """Why doctor must not log in as ``node`` now, if it must not: Mosquitto makes the
    certificate's name the client id, so a second login would take over the running
    node's connection."""
    what = "MQTT round trip"
    if running.running:
        return skip(
            what,
            f"node {node} is running ({running.how}): logging in as it would take over its "
            "MQTT session; stop it to run this check",
        )
    if running.running is None:
        return skip(
            what,
            f"cannot tell whether node {node} runs ({running.how}); a login as it would take "
            "over its session. Stop it and run doctor again",
        )
    return None


@dataclass(frozen=True)
class Login:
    """How doctor logs in to measure round trips."""

    client_id: str
    clean_start: bool
    session_expiry_s: int


def login_for(mqtt: MqttSettings, role: str, node: str, suffix: str) -> Login:
    """With TLS Mosquitto makes the certificate's name (the node id) the client id, so
    doctor logs in to the node's own persistent session: never with a clean start (that
    would wipe the session and the jobs queued in it) and with the node's session expiry
    (a broker keeps none). In plaintext mode a client id of doctor's own touches no one's
    session."""
    if mqtt.tls_cert_file is None:
        return Login(f"sg-doctor-{node}-{suffix}", True, 0)
    expiry = 0 if role == "broker" else mqtt.session_expiry_s
    return Login(node, False, expiry)


def nagle_suspected(p50_ms: float, connect_ms: float | None) -> bool:
    """A slow round trip over a near network: Mosquitto without ``set_tcp_nodelay``."""
    return p50_ms >= NAGLE_RTT_MS and connect_ms is not None and connect_ms < NEAR_CONNECT_MS


_ACL_FIX = (
    "regenerate the ACL from the policy ('sluicegate policy acl', which lets every node write "
    "and read {topic}) and reload Mosquitto (SIGHUP)"
)
_TRIP_FIX = {
    "login": "check that Mosquitto accepts this node (the TLS checks above) and read its log",
    "subscribe": _ACL_FIX,
    "publish": _ACL_FIX,
    "deliver": "if the node was down while work was queued for it, its session delivers that "
    "first: start the node, let it drain (doctor leaves those messages to it), stop it and "
    "check again; otherwise read Mosquitto's log",
}


def judge_round_trip(trip: RoundTrip, connect_ms: float | None) -> Finding:
    what = "MQTT round trip"
    if trip.error is not None:
        return fail(what, trip.error, _TRIP_FIX[trip.stage or "login"].format(topic=trip.topic))
    if not trip.rtts_ms:
        return fail(what, "no round trip was measured", "run doctor again")
    p50 = statistics.median(trip.rtts_ms)
    near = f"{connect_ms:.1f} ms" if connect_ms is not None else "unknown"
    said = f"p50 {p50:.1f} ms over {len(trip.rtts_ms)} QoS 1 round trips on {trip.topic}"
    if nagle_suspected(p50, connect_ms):
        return fail(
            what,
            f"{said} while a TCP connect takes {near}: Mosquitto holds small packets back "
            "(Nagle's algorithm, ~40 ms each)",
            NODELAY_FIX,
        )
    if p50 >= NAGLE_RTT_MS:
        return ok(
            what,
            f"{said} (TCP connect {near})",
            Warn(
                "slow, over a network too far to tell Nagle's delay from distance",
                f"if Mosquitto's configuration lacks it: {NODELAY_FIX}",
            ),
        )
    return ok(what, f"{said} (TCP connect {near})")
