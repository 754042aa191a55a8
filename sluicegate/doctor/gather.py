"""The facts ``sluicegate doctor`` judges, read from this machine and the network.

Each function looks and reports; none decides (that is :mod:`sluicegate.doctor.judge`) and
none raises for what it finds: a failure is a fact with its words. Nothing here changes a
node's state: the policy feed runs on a copy of the node's policy files, a state folder
that does not exist is not created, the probe file is removed at once, and the node's lock
is only tried, never kept. The MQTT login is :mod:`sluicegate.doctor.probe`'s.
"""

from __future__ import annotations

import contextlib
import email.utils
import fcntl
import json
import os
import shutil
import socket
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from cryptography import x509

from policies.errors import PolicyError
from sluicegate import pki
from sluicegate.config import MqttSettings
from sluicegate.doctor.facts import (
    BrokerClock,
    Connect,
    Handshake,
    Models,
    PolicyState,
    Running,
    StateDir,
    TlsFiles,
)
from sluicegate.errors import ConfigError, IdentityError, SluicegateError
from sluicegate.identity import lock_path
from sluicegate.policy_feed import ANCHOR_FILE, ENVELOPE_FILE, PolicyFeed

CONNECT_TIMEOUT_S = 3.0
CONNECT_TRIES = 3
HTTP_TIMEOUT_S = 5.0
# After the handshake a TLS 1.3 server judges the client's certificate; a refusal arrives
# as an alert within a round trip, an acceptance as silence (it waits for CONNECT).
ALERT_WAIT_S = 1.0


def tcp_connect(host: str, port: int) -> Connect:
    """A few TCP connects to ``host:port``: the fastest, or the first error."""
    best: float | None = None
    for _ in range(CONNECT_TRIES):
        start = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
                took = (time.perf_counter() - start) * 1000.0
        except OSError as exc:
            return Connect(host, port, _words(exc))
        best = took if best is None else min(best, took)
    return Connect(host, port, None, best)


def _words(exc: OSError) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {CONNECT_TIMEOUT_S:.0f} s"
    return exc.strerror or str(exc)


def _cert(path: Path) -> tuple[x509.Certificate | None, str | None]:
    try:
        return pki.read_cert(path), None
    except IdentityError as exc:
        return None, str(exc)


def tls_files(mqtt: MqttSettings) -> TlsFiles:
    """The CA and node certificate of ``[mqtt]``, and whether the key loads with the
    certificate (``tls_ca_file`` must be set)."""
    assert mqtt.tls_ca_file is not None
    ca, ca_error = _cert(mqtt.tls_ca_file)
    cert, cert_error, key_error = None, None, None
    if mqtt.tls_cert_file is not None:
        cert, cert_error = _cert(mqtt.tls_cert_file)
        if cert is not None and mqtt.tls_key_file is not None:
            try:
                ssl.create_default_context().load_cert_chain(mqtt.tls_cert_file, mqtt.tls_key_file)
            except (OSError, ssl.SSLError) as exc:
                key_error = f"{mqtt.tls_key_file}: {exc}"
    return TlsFiles(mqtt.tls_ca_file, ca, ca_error, mqtt.tls_cert_file, cert, cert_error, key_error)


def handshake(mqtt: MqttSettings) -> Handshake:
    """A TLS handshake with ``[mqtt] host:port`` as paho makes it: the CA of
    ``tls_ca_file``, the host name checked, the node's certificate. No MQTT is spoken, so
    no session is touched."""
    assert mqtt.tls_ca_file is not None
    host, port = mqtt.host, mqtt.port
    try:
        context = ssl.create_default_context(cafile=str(mqtt.tls_ca_file))
        if mqtt.tls_cert_file is not None and mqtt.tls_key_file is not None:
            context.load_cert_chain(mqtt.tls_cert_file, mqtt.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        return Handshake(error=f"cannot load the TLS files: {exc}")
    try:
        with (
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            der = tls.getpeercert(binary_form=True)
            version = tls.version()
            alert = _server_verdict(tls)
    except ssl.SSLCertVerificationError as exc:
        return Handshake(
            verify_code=exc.verify_code,
            verify_error=exc.verify_message,
            server_cert=_unverified_cert(host, port),
        )
    except ssl.SSLError as exc:  # an alert during the handshake itself (TLS 1.2)
        if exc.reason and "ALERT" in exc.reason:
            return Handshake(alert=exc.reason)
        return Handshake(error=str(exc))
    except OSError as exc:
        return Handshake(error=_words(exc))
    server = x509.load_der_x509_certificate(der) if der else None
    return Handshake(alert=alert, server_cert=server, version=version)


def _server_verdict(tls: ssl.SSLSocket) -> str | None:
    """The server's alert refusing our certificate, or None once it stays silent."""
    tls.settimeout(ALERT_WAIT_S)
    try:
        data = tls.recv(1)
    except TimeoutError:
        return None
    except ssl.SSLError as exc:
        return exc.reason or str(exc)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None if data else "CONNECTION_CLOSED"


def _unverified_cert(host: str, port: int) -> x509.Certificate | None:
    """The certificate the server presents, not verified: to say what is wrong with it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            der = tls.getpeercert(binary_form=True)
    except OSError:
        return None
    return x509.load_der_x509_certificate(der) if der else None


def enrolled_broker_url(state_dir: Path | None, record: str) -> str | None:
    """``broker_url`` from the enrollment record in the node's state folder, if any."""
    if state_dir is None:
        return None
    try:
        doc = json.loads((state_dir / record).read_text())
    except (OSError, ValueError):
        return None
    url = doc.get("broker_url") if isinstance(doc, dict) else None
    return url if isinstance(url, str) and url else None


def broker_clock(url: str, ca_file: Path | None, clock: Callable[[], float]) -> BrokerClock:
    """``GET <url>/health`` and its ``Date`` header, with this clock around it."""
    url = url.rstrip("/")
    context = None
    if url.startswith("https:") and ca_file is not None:
        context = ssl.create_default_context(cafile=str(ca_file))
    sent = clock()
    try:
        with urllib.request.urlopen(
            f"{url}/health", timeout=HTTP_TIMEOUT_S, context=context
        ) as response:
            header = response.headers.get("Date")
    except urllib.error.HTTPError as exc:  # an unhealthy broker still says the time
        header = exc.headers.get("Date")
    except (OSError, ValueError) as exc:
        return BrokerClock(url, sent, clock(), error=str(getattr(exc, "reason", exc)))
    received = clock()
    date = None
    if header:
        with contextlib.suppress(TypeError, ValueError):
            date = email.utils.parsedate_to_datetime(header).timestamp()
    return BrokerClock(url, sent, received, date=date)


def policy_state(
    node: str, policy_file: Path | None, state_dir: Path | None, *, now: float
) -> PolicyState:
    """What the node's policy feed makes of its files (``load()``, ``require_anchor()``),
    run on copies so that nothing is pinned or written in the node's own folder."""
    found: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sg-doctor-") as tmp:
        copy = Path(tmp)
        for name in (ANCHOR_FILE, ENVELOPE_FILE) if state_dir is not None else ():
            assert state_dir is not None
            try:
                shutil.copyfile(state_dir / name, copy / name)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                return PolicyState(str(state_dir), error=f"cannot read {state_dir / name}: {exc}")
            found.append(str(state_dir / name))
        if policy_file is not None:
            found.append(str(policy_file))
        sources = ", ".join(found) or f"no policy files (in {state_dir}, no policy_file)"
        feed = PolicyFeed(node=node, policy_file=policy_file, state_dir=copy, clock=lambda: now)
        error = None
        try:
            feed.load()
            feed.require_anchor()
        except (SluicegateError, PolicyError) as exc:
            error = str(exc).replace(str(copy), str(state_dir))
        last = (
            feed.last_refusal.message.replace(str(copy), str(state_dir))
            if feed.last_refusal
            else None
        )
        return PolicyState(
            sources,
            policy=feed.held,
            anchor=feed.anchor,
            refused=tuple(sorted(feed.refused)),
            last_refusal=last,
            error=error,
        )


def models(folder: Path, setting: str) -> Models:
    """Load and verify every model in ``folder`` as the node does at start."""
    from sluicegate.vision.runtime import ModelRegistry

    try:
        registry = ModelRegistry.from_dir(folder)
    except SluicegateError as exc:
        return Models(folder, setting, error=str(exc))
    return Models(folder, setting, tuple(registry.names()))


def state_dir(path: Path, setting: str) -> StateDir:
    """Whether ``path`` is a folder this user can write (a probe file made and removed),
    or could create, and the free space of its disk. It creates nothing that stays."""
    if path.is_dir():
        return StateDir(path, setting, True, True, write_error=_probe(path), free_bytes=_free(path))
    if path.exists() or path.is_symlink():
        return StateDir(path, setting, True, False)
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    blocker = None
    if not ancestor.is_dir():
        blocker = f"{ancestor} is a file, not a folder"
    elif not os.access(ancestor, os.W_OK | os.X_OK):
        blocker = f"this user may not create folders in {ancestor}"
    free = _free(ancestor) if blocker is None else None
    return StateDir(path, setting, False, False, blocker=blocker, free_bytes=free)


def _probe(folder: Path) -> str | None:
    probe = folder / f".sluicegate-doctor-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"sluicegate doctor\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink()
        return f"{probe}: {exc.strerror}"
    return None


def _free(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def node_running(lock_dir: Path, node: str) -> Running:
    """Whether a process holds the node's state lock (``sluicegate.identity.node_lock``):
    tried without blocking and let go at once, never created."""
    path = lock_path(lock_dir, node)
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return Running(False, f"no lock file {path}")
    except OSError as exc:
        return Running(None, f"cannot open its lock file {path}: {exc.strerror}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 300).decode(errors="replace").strip() or "a process"
        return Running(True, f"{holder} holds {path}")
    finally:
        os.close(fd)  # lets go of the lock if it was taken here
    return Running(False, f"no process holds {path}")


def broker_running(redis_url: str, broker_id: str) -> Running:
    """Whether a broker replica holds its lease in Redis (``broker.lease``)."""
    from redis.exceptions import RedisError

    from broker import keys
    from sluicegate.redis_url import sync_client

    try:
        client = sync_client(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    except ConfigError as exc:
        return Running(None, f"its replica lease cannot be read: {exc}")
    try:
        holder = client.get(keys.replica_lease(broker_id))
    except RedisError as exc:
        return Running(None, f"its replica lease cannot be read ([broker] redis_url): {exc}")
    finally:
        client.close()
    if holder is None:
        return Running(False, "no replica lease in Redis")
    text = holder.decode(errors="replace") if isinstance(holder, bytes) else str(holder)
    return Running(True, f"instance {text} holds its replica lease in Redis")
