"""The judgements of ``sluicegate doctor``: facts in, one :class:`Finding` out, each with
the fix a person can carry out.

Pure: no file, socket or clock of their own (``now`` is passed in), so the tests table
them with facts made up on the spot and the command runs the very same functions over the
facts it measured. Thresholds live here as named constants; docs/deployment.md explains
each check.
"""

from __future__ import annotations

import datetime as dt
import statistics
from dataclasses import dataclass

from cryptography import x509

from sluicegate import pki
from sluicegate.config import MqttSettings
from sluicegate.doctor.facts import (
    BrokerClock,
    Connect,
    Finding,
    Handshake,
    Models,
    PolicyState,
    RoundTrip,
    Running,
    StateDir,
    TlsFiles,
    Warn,
    fail,
    ok,
    skip,
)
from sluicegate.errors import ConfigError, IdentityError
from sluicegate.identity import check_client_identity

CERT_WARN_DAYS = 30.0
POLICY_WARN_DAYS = 7.0
SKEW_WARN_S = 2.0
SKEW_FAIL_S = 5  # without a pinned policy; with one, its [tokens] max_skew_s
DISK_WARN_BYTES = 1024**3
DISK_FAIL_BYTES = 100 * 1024**2
# Nagle's algorithm holds a small packet until the previous one is acknowledged, and the
# receiver delays that ACK by ~40 ms: 44.5 ms a round trip against 11 ms with nodelay.
NAGLE_RTT_MS = 20.0
NEAR_CONNECT_MS = 2.0
NODELAY_FIX = "set_tcp_nodelay true in mosquitto.conf (sluicegate mosquitto config writes it)"
# OpenSSL's X509_V_ERR codes for a chain that does not lead to the CA given.
UNKNOWN_CA = frozenset({2, 18, 19, 20, 21, 7})
CERT_NOT_YET_VALID, CERT_EXPIRED, HOSTNAME_MISMATCH = 9, 10, 62
# Refusals that mean a policy was tampered with or signed by the wrong people (every
# ``PolicyRefused`` reason but an older version offered beside a newer one).
HARMLESS_REFUSALS = frozenset({"policy.rollback"})
TLS_SETTINGS = "[mqtt] tls_ca_file, tls_cert_file and tls_key_file"


def _date(moment: dt.datetime | float) -> str:
    if isinstance(moment, float | int):
        moment = dt.datetime.fromtimestamp(moment, dt.UTC)
    return f"{moment:%Y-%m-%dT%H:%M:%SZ}"


def _enroll_fix(role: str) -> str:
    return (
        f"enroll the node ('sluicegate {role} install --join TOKEN' writes node.pem, node.key "
        f"and ca.pem and sets {TLS_SETTINGS}), or point them at its own files"
    )


def judge_config(source: str, error: str | None, role: str, node: str) -> Finding:
    if error is not None and "does not exist" in error:
        return fail(
            "config",
            error,
            f"pass --config with the node's settings file (installed: /etc/sluicegate/{role}.toml)",
        )
    if error is not None:
        return fail(
            "config",
            error,
            "correct the file or the SLUICEGATE_* variable named (sluicegate config show "
            "--config FILE lists every value and where it came from)",
        )
    return ok("config", f"{source} loads: {role} {node}")


def judge_identity(
    mqtt: MqttSettings, node: str, role: str, cert_name: str | None, cert_error: str | None
) -> Finding:
    """The node connects as itself (:func:`sluicegate.identity.check_client_identity`)."""
    if cert_error is not None:
        return fail("identity", cert_error, _enroll_fix(role))
    try:
        check_client_identity(mqtt, node, cert_name)
    except ConfigError as exc:
        return fail("identity", str(exc), _enroll_fix(role))
    if mqtt.tls_ca_file is None:
        return ok(
            "identity",
            f"{node}, in plaintext mode ([mqtt] plaintext = true)",
            Warn(
                "no TLS and no client certificate: anyone on the network can read this "
                "node's messages and forge them",
                f"debugging only: {_enroll_fix(role)}, and remove [mqtt] plaintext",
            ),
        )
    return ok("identity", f"connects as {node} with its own certificate {mqtt.tls_cert_file}")


def judge_reachable(connect: Connect) -> Finding:
    what = f"MQTT broker {connect.host}:{connect.port}"
    if connect.error is not None or connect.best_ms is None:
        return fail(
            what,
            f"cannot connect: {connect.error}",
            "set [mqtt] host and port (or SLUICEGATE_MQTT__HOST / SLUICEGATE_MQTT__PORT) to "
            "the campus's Mosquitto, and check that it runs and no firewall is in the way",
        )
    return ok(what, f"reachable (TCP connect {connect.best_ms:.1f} ms)")


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


CA_FIX = (
    "set [mqtt] tls_ca_file to the campus CA certificate (ca.pem: enrollment writes it "
    "into the node's state folder; 'sluicegate ca init' made it)"
)


def judge_ca(files: TlsFiles) -> Finding:
    what = f"CA file {files.ca_file}"
    if files.ca is None:
        return fail(what, files.ca_error or "unreadable", CA_FIX)
    name = pki.common_name(files.ca)
    if not _is_ca(files.ca):
        return fail(what, f"is the certificate of {name!r}, not a certificate authority", CA_FIX)
    return ok(what, f"{name!r}, {pki.cert_fingerprint(files.ca)[:23]}…")


def judge_node_cert(files: TlsFiles, role: str, *, now: float) -> Finding:
    what = "node certificate"
    cert, ca = files.cert, files.ca
    if files.cert_file is None:
        return skip(what, "no [mqtt] tls_cert_file")
    what = f"node certificate {files.cert_file}"
    if cert is None:
        return fail(what, files.cert_error or "unreadable", _enroll_fix(role))
    if files.key_error is not None:
        return fail(
            what,
            f"its key does not load with it: {files.key_error}",
            "set [mqtt] tls_key_file to the key this certificate was issued for (node.key "
            "beside node.pem)",
        )
    if ca is None:
        return skip(what, "the CA file did not load, so it cannot be checked against it")
    days = pki.days_left(cert, now=now)
    try:
        pki.check_issued(cert, ca, now=now)
    except IdentityError as exc:
        if days <= 0:
            fix = (
                f"renew it: enroll the node again ('sluicegate {role} install --join TOKEN' "
                "with a new token), or have the campus CA issue it a new certificate"
            )
        elif now < cert.not_valid_before_utc.timestamp():
            fix = "set this machine's clock right (timedatectl set-ntp true), then check again"
        else:
            fix = (
                "use the certificate the campus CA issued to this node, or set [mqtt] "
                "tls_ca_file to the CA that issued it"
            )
        return fail(what, str(exc), fix)
    warnings = []
    if days < CERT_WARN_DAYS:
        warnings.append(
            Warn(
                f"expires in {days:.0f} days ({_date(cert.not_valid_after_utc)})",
                f"renew it before then: enroll the node again ('sluicegate {role} install "
                "--join TOKEN')",
            )
        )
    detail = (
        f"{pki.common_name(cert)!r}, issued by {pki.common_name(ca)!r}, valid until "
        f"{_date(cert.not_valid_after_utc)} ({days:.0f} days)"
    )
    return ok(what, detail, *warnings)


_ALERTS = {
    "TLSV1_ALERT_UNKNOWN_CA": (
        "its issuer is not the CA Mosquitto trusts",
        "enroll the node with this campus (its CA issues the certificate Mosquitto's "
        "cafile trusts)",
    ),
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": (
        "it has expired",
        "renew it: enroll the node again with a new join token",
    ),
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": (
        "none was sent",
        f"set {TLS_SETTINGS} to the node's own certificate and key",
    ),
}


def _sans(cert: x509.Certificate) -> str:
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "no names"
    return ", ".join(str(n.value) for n in names) or "no names"


def judge_server_tls(shake: Handshake, files: TlsFiles, host: str, port: int, role: str) -> Finding:
    """The server's chain verifies against the node's CA and names ``host``, and the server
    accepts the node's certificate, as paho's handshake would find."""
    what = f"TLS to {host}:{port}"
    server = shake.server_cert
    ca_name = pki.common_name(files.ca) if files.ca is not None else str(files.ca_file)
    if shake.verify_code in UNKNOWN_CA:
        issuer = _issuer(server)
        return fail(
            what,
            f"wrong CA: the server's certificate{issuer} does not chain to [mqtt] "
            f"tls_ca_file {files.ca_file} ({ca_name!r}): {shake.verify_error}",
            "set [mqtt] tls_ca_file to the campus CA that issued Mosquitto's certificate "
            "(the ca.pem enrollment wrote), or point [mqtt] host at the campus's Mosquitto",
        )
    if shake.verify_code == HOSTNAME_MISMATCH or (
        server is not None and shake.verify_code is None and not pki.names_host(server, host)
    ):
        names = _sans(server) if server is not None else "other names"
        return fail(
            what,
            f"the server's certificate names {names}, not {host!r}",
            f"set [mqtt] host to a name the certificate lists, or issue Mosquitto a server "
            f"certificate for {host!r} from the campus CA",
        )
    if shake.verify_code in (CERT_EXPIRED, CERT_NOT_YET_VALID):
        return fail(
            what,
            f"the server's certificate is not valid now: {shake.verify_error}",
            "issue Mosquitto a new server certificate from the campus CA and restart it; if "
            "it is not yet valid, set the clocks right (NTP)",
        )
    if shake.verify_code is not None:
        return fail(
            what,
            f"the server's certificate does not verify: {shake.verify_error}",
            "issue Mosquitto a server certificate from the campus CA for this host",
        )
    if shake.alert is not None:
        why, fix = _ALERTS.get(shake.alert, (shake.alert, _enroll_fix(role)))
        return fail(what, f"Mosquitto refused this node's certificate: {why} ({shake.alert})", fix)
    if shake.error is not None:
        return fail(
            what,
            f"no TLS handshake: {shake.error}",
            "check that [mqtt] port is Mosquitto's TLS listener (8883 in a plant), not a "
            "plain MQTT one",
        )
    detail = (
        f"the server's certificate verifies against {ca_name!r} and names {host}; Mosquitto "
        f"accepts this node's certificate ({shake.version})"
    )
    return ok(what, detail)


def _issuer(cert: x509.Certificate | None) -> str:
    if cert is None:
        return ""
    issuer = cert.issuer.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    name = str(issuer[0].value) if issuer else cert.issuer.rfc4514_string()
    return f" ({pki.common_name(cert)!r}, issued by {name!r})"


@dataclass(frozen=True)
class Skew:
    """This clock against the broker's: broker minus local, and how far off that may be
    (the ``Date`` header's whole seconds and the request's own time)."""

    seconds: float
    slack: float

    @property
    def least(self) -> float:
        """The smallest skew the measurement allows (what a failure is judged by)."""
        return max(0.0, abs(self.seconds) - self.slack)


def skew_of(clock: BrokerClock) -> Skew | None:
    if clock.date is None:
        return None
    middle = (clock.sent + clock.received) / 2.0
    # The header says D: the broker's clock read somewhere in [D, D + 1).
    return Skew(clock.date + 0.5 - middle, 0.5 + (clock.received - clock.sent) / 2.0)


def judge_clock(clock: BrokerClock, max_skew_s: int | None) -> Finding:
    what = "clock"
    if clock.error is not None:
        return fail(
            what,
            f"cannot read the broker's time from {clock.url}/health: {clock.error}",
            "pass --broker-url http://HOST:PORT of a running broker replica ([broker] "
            "http_host, http_port), or run doctor where that API is reachable",
        )
    skew = skew_of(clock)
    if skew is None:
        return fail(
            what,
            f"{clock.url}/health sent no Date header",
            "point --broker-url at a Sluicegate broker's HTTP API",
        )
    limit = max_skew_s if max_skew_s is not None else SKEW_FAIL_S
    source = "policy's [tokens] max_skew_s" if max_skew_s is not None else "default limit"
    side = "behind" if skew.seconds > 0 else "ahead of"
    said = f"this clock is {abs(skew.seconds):.1f} s (± {skew.slack:.1f} s) {side} the broker's"
    ntp = (
        "synchronise this machine's clock and the broker's with NTP (timedatectl "
        "set-ntp true, or chrony)"
    )
    if skew.least > limit:
        return fail(
            what,
            f"{said}; the {source} is {limit} s, so placement tokens would be refused",
            ntp,
        )
    warnings = []
    if abs(skew.seconds) > SKEW_WARN_S:
        warnings.append(Warn(f"{said} (limit {limit} s)", ntp))
    within = abs(skew.seconds) + skew.slack
    return ok(
        what, f"within {within:.1f} s of the broker's ({clock.url}; limit {limit} s)", *warnings
    )


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


def judge_policy(state: PolicyState, role: str, setting: str, *, now: float) -> Finding:
    """The policy the node would hold: verified against its pinned anchor, current, and no
    candidate refused for its signatures."""
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
            f"policy v{policy.version} expired at {_date(policy.expires)}",
            fix("policy.expired"),
        )
    warnings = []
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
        f"{_date(policy.expires)}"
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
