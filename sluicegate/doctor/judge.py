"""The judgements of ``sluicegate doctor`` about the connection: the configuration, the
identity it connects as, reachability, the CA and the node's certificate, the TLS handshake,
the clock against the broker's. Facts in, one :class:`Finding` out, each with the fix a
person can carry out; the node's own state is judged in :mod:`sluicegate.doctor.judge_node`.

Pure: no file, socket or clock of their own (``now`` is passed in), so the tests table
them with facts made up on the spot and the command runs the very same functions over the
facts it measured. Thresholds live here as named constants; docs/deployment.md explains
each check.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from cryptography import x509

from sluicegate import pki
from sluicegate.config import MqttSettings
from sluicegate.doctor.facts import (
    BrokerClock,
    Connect,
    Finding,
    Handshake,
    TlsFiles,
    Warn,
    fail,
    ok,
    skip,
)
from sluicegate.errors import ConfigError, IdentityError
from sluicegate.identity import check_client_identity

CERT_WARN_DAYS = 30.0
SKEW_WARN_S = 2.0
SKEW_FAIL_S = 5  # without a pinned policy; with one, its [tokens] max_skew_s
# OpenSSL's X509_V_ERR codes for a chain that does not lead to the CA given.
UNKNOWN_CA = frozenset({2, 18, 19, 20, 21, 7})
CERT_NOT_YET_VALID, CERT_EXPIRED, HOSTNAME_MISMATCH = 9, 10, 62
TLS_SETTINGS = "[mqtt] tls_ca_file, tls_cert_file and tls_key_file"


def date_text(moment: dt.datetime | float) -> str:
    """A moment as the findings print it (UTC, whole seconds)."""
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
                f"expires in {days:.0f} days ({date_text(cert.not_valid_after_utc)})",
                f"renew it before then: enroll the node again ('sluicegate {role} install "
                "--join TOKEN')",
            )
        )
    detail = (
        f"{pki.common_name(cert)!r}, issued by {pki.common_name(ca)!r}, valid until "
        f"{date_text(cert.not_valid_after_utc)} ({days:.0f} days)"
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
