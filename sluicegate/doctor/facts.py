"""What ``sluicegate doctor`` found out about a node, as plain values, and what it says.

The gatherers (:mod:`sluicegate.doctor.gather`, :mod:`sluicegate.doctor.probe`) fill these
in from files, sockets, HTTP and MQTT; the judgements (:mod:`sluicegate.doctor.judge`) turn
them into :class:`Finding` lines. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509

from policies import Policy, TrustAnchor

Status = Literal["OK", "FAIL", "SKIP"]


@dataclass(frozen=True)
class Warn:
    """Something that works today but wants attention."""

    text: str
    fix: str


@dataclass(frozen=True)
class Finding:
    """One check's verdict: ``detail`` says what was found (OK), what is wrong (FAIL) or
    why the check cannot apply (SKIP); ``fix`` is what to do about a FAIL."""

    status: Status
    what: str
    detail: str = ""
    fix: str = ""
    warnings: tuple[Warn, ...] = ()

    def lines(self) -> list[str]:
        if self.status == "OK":
            head = f"OK {self.what}" + (f": {self.detail}" if self.detail else "")
        elif self.status == "FAIL":
            head = f"FAIL {self.what}: {self.detail} — fix: {self.fix}"
        else:
            head = f"SKIP {self.what}: {self.detail}"
        return [head] + [f"WARN {self.what}: {w.text} — fix: {w.fix}" for w in self.warnings]


def ok(what: str, detail: str = "", *warnings: Warn) -> Finding:
    return Finding("OK", what, detail, warnings=warnings)


def fail(what: str, detail: str, fix: str) -> Finding:
    return Finding("FAIL", what, detail, fix)


def skip(what: str, why: str) -> Finding:
    return Finding("SKIP", what, why)


@dataclass(frozen=True)
class Connect:
    """TCP connects to ``[mqtt] host:port``: the fastest one, or why none succeeded."""

    host: str
    port: int
    error: str | None
    best_ms: float | None = None


@dataclass(frozen=True)
class TlsFiles:
    """The node's TLS files as read: each certificate, or why it could not be read; and
    whether its key loads with its certificate (as paho loads them)."""

    ca_file: Path
    ca: x509.Certificate | None
    ca_error: str | None
    cert_file: Path | None
    cert: x509.Certificate | None
    cert_error: str | None
    key_error: str | None


@dataclass(frozen=True)
class Handshake:
    """A TLS handshake with the MQTT server as paho makes it (the campus CA, hostname
    checked, the node's certificate), without logging in.

    ``verify_code``/``verify_error``: this side refused the server's certificate
    (OpenSSL's X509_V_ERR code); ``alert``: the server refused ours after the handshake
    (e.g. ``TLSV1_ALERT_UNKNOWN_CA``); ``error``: anything else that stopped it.
    ``server_cert`` is the certificate the server presented, fetched without verification
    when verification failed."""

    error: str | None = None
    verify_code: int | None = None
    verify_error: str | None = None
    alert: str | None = None
    server_cert: x509.Certificate | None = None
    version: str | None = None


@dataclass(frozen=True)
class BrokerClock:
    """One ``GET /health`` of the broker's HTTP API: its ``Date`` header (whole seconds)
    and this machine's clock just before and just after."""

    url: str
    sent: float
    received: float
    date: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class PolicyState:
    """The node's policy feed after ``load()`` and ``require_anchor()``: the policy it
    holds (expired or not), its pinned anchor, each refused candidate's reason code and
    the last refusal's words, or the error that stopped it."""

    sources: str
    policy: Policy | None = None
    anchor: TrustAnchor | None = None
    refused: tuple[str, ...] = ()
    last_refusal: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Models:
    folder: Path
    setting: str
    names: tuple[str, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class StateDir:
    """The node's state folder: whether it is one, could be made, takes a file, and the
    free space where it is (or would be)."""

    path: Path
    setting: str
    exists: bool
    is_dir: bool
    blocker: str | None = None  # why it cannot be created (a file in the way, no access)
    write_error: str | None = None
    free_bytes: int | None = None


@dataclass(frozen=True)
class Running:
    """Whether the node's own process runs: True (``how`` says who), False, or None when
    this cannot be told (``how`` says why)."""

    running: bool | None
    how: str


@dataclass(frozen=True)
class RoundTrip:
    """QoS 1 round trips through Mosquitto on the node's probe topic, logged in as the
    node; ``error`` when the login, subscription or a message failed."""

    topic: str
    rtts_ms: tuple[float, ...] = ()
    error: str | None = None
    stage: Literal["login", "subscribe", "publish", "deliver"] | None = None
