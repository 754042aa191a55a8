"""Starts and stops local ``mosquitto``, ``redis-server`` and Redis Sentinel processes on
free ports.

The demo and the test fixtures use this to run against real servers. It owns the
configuration those servers get (no Nagle delay, loopback only, no disk persistence unless
asked; Mosquitto either open to anonymous clients, for tests of single roles, or secured
as a campus runs it: TLS, client certificates, the generated ACL) and the readiness check:
a server counts as started once it accepts a connection and answers its protocol's ping
(over TLS with a probe certificate for a secured Mosquitto), never after a fixed sleep. A
server can be killed or stopped and started again on the same port with the same data
directory, which is how the fault tests and ``bench/chaos.py`` crash and restart them.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sluicegate.errors import SluicegateError
from sluicegate.mosquitto import ListenerTls, secure_listener


class ServerError(SluicegateError):
    """A local server could not be started."""


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_SPAN = 16384  # the ports below the ephemeral range that servers are given
# The ports this process handed out lately: one not bound yet by the server it was given to
# looks free, and a second server given it too fails to start (a campus asks for dozens).
_HANDED: deque[int] = deque(maxlen=4096)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to right now, below the kernel's range
    of ephemeral ports. Binding port 0 would give one from that range, which any outgoing
    connection may take in the moment before the server that was given it binds it: a suite
    that opens thousands of connections lost a broker's HTTP port that way. Never one this
    process handed out lately: the server given it may not have bound it yet."""
    low = _ephemeral_low()
    candidates = range(max(1024, low - LISTEN_SPAN), low)
    for port in random.sample(candidates, min(200, len(candidates))):
        if port not in _HANDED and _bound(port) == port:
            _HANDED.append(port)
            return port
    chosen = _bound(0)  # the kernel's choice
    if chosen is None:
        raise ServerError("no TCP port on 127.0.0.1 could be bound")
    _HANDED.append(chosen)
    return chosen


def _bound(port: int) -> int | None:
    """The port a socket bound on 127.0.0.1 got (0: the kernel's choice), None if taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:  # in use (or lingering)
            return None
        got: int = sock.getsockname()[1]
        return got


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def find_binary(name: str) -> str:
    """Path of a server binary, looking in PATH and the usual sbin folders."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin:/sbin")
    if found is None:
        raise ServerError(
            f"{name!r} is not installed; install it with your package manager "
            f"(e.g. 'apt-get install mosquitto redis-server') or run scripts/bootstrap"
        )
    return found


@dataclass
class ServerProcess:
    """A running server: where it listens and how to stop it."""

    name: str
    host: str
    port: int
    process: subprocess.Popen[bytes]
    workdir: Path
    argv: list[str] = field(default_factory=list)
    # A secured Mosquitto's readiness ping goes over TLS with this context (a probe's
    # client certificate from the campus CA).
    tls: ssl.SSLContext | None = None

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the process (SIGTERM, then SIGKILL after ``timeout``)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the process, as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        """Start the server again on the same port and data directory, after a stop or a
        kill; a server that is still running is left alone."""
        if self.alive:
            return
        self.process = _spawn(self.argv, self.workdir)
        _wait_ready(self, timeout)

    def restart(self, timeout: float = 10.0, *, kill: bool = False) -> None:
        """Stop (SIGTERM: a graceful stop, which saves state; ``kill``: SIGKILL, a crash)
        and start the same server again on the same port and data directory."""
        if kill:
            self.kill()
        else:
            self.stop()
        self.start(timeout)


def _spawn(argv: list[str], workdir: Path) -> subprocess.Popen[bytes]:
    with (workdir / "server.log").open("ab") as log:
        # The child keeps its own copy of the descriptor; ours can close at once.
        return subprocess.Popen(
            argv, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _ping(name: str, host: str, port: int, tls: ssl.SSLContext | None = None) -> bool:
    try:
        with contextlib.ExitStack() as stack:
            sock: socket.socket = stack.enter_context(
                socket.create_connection((host, port), timeout=0.5)
            )
            if tls is not None:
                sock = stack.enter_context(tls.wrap_socket(sock, server_hostname=host))
            if name == "redis":
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
            # MQTT v5 CONNECT with a clean start and 10 s keepalive; expect a CONNACK.
            client_id = b"sg-ping"
            body = (
                b"\x00\x04MQTT\x05\x02\x00\x0a\x00" + len(client_id).to_bytes(2, "big") + client_id
            )
            sock.sendall(bytes([0x10, len(body)]) + body)
            ack = sock.recv(16)
            sock.sendall(b"\xe0\x00")  # DISCONNECT
            return ack[:1] == b"\x20"
    except OSError:  # ssl.SSLError included
        return False


def _wait_ready(server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            log = (server.workdir / "server.log").read_text(errors="replace")[-2000:]
            raise ServerError(f"{server.name} exited with {server.process.returncode}: {log}")
        if _ping(server.name, server.host, server.port, server.tls):
            return
        time.sleep(0.02)  # polling interval while waiting for the readiness event
    server.stop()
    raise ServerError(f"{server.name} did not answer on {server.host}:{server.port} in {timeout}s")


def mosquitto_config(
    port: int,
    workdir: Path,
    *,
    persistence: bool = False,
    autosave_interval_s: int = 1,
    max_queued_messages: int = 1_000_000,
    max_inflight_messages: int = 0,
    tls: ListenerTls | None = None,
) -> str:
    """The mosquitto.conf the demo and tests use.

    With ``tls`` it is the campus's secured listener (``sluicegate.mosquitto``): client
    certificates from the campus CA, identities as usernames and client ids, the ACL;
    without, a plain listener open to anonymous clients, for tests of a single role.

    With ``persistence`` Mosquitto keeps retained messages, persistent sessions and their
    queued QoS 1 messages in ``workdir/mosquitto.db``, written every ``autosave_interval_s``
    and on a graceful stop (SIGTERM); a SIGKILL loses what arrived since the last save. A
    client's session may hold up to ``max_queued_messages`` messages while it is away (0: no
    limit); ``max_inflight_messages`` bounds unacknowledged QoS 1 deliveries per client (0:
    no limit).
    """
    if autosave_interval_s < 1:
        raise ServerError(f"autosave_interval_s must be >= 1 s, got {autosave_interval_s}")
    if tls is None:
        listener = [f"listener {port} 127.0.0.1", "allow_anonymous true"]
    else:
        listener = secure_listener(port, "127.0.0.1", tls)
    lines = [
        *listener,
        # Started as root, Mosquitto would switch to the user "mosquitto", which may not
        # write ``workdir``: persistence would then fail on every save (a log line only).
        f"user {pwd.getpwuid(os.geteuid()).pw_name}",
        "set_tcp_nodelay true",
        f"max_inflight_messages {max_inflight_messages}",
        f"max_queued_messages {max_queued_messages}",
        "max_queued_bytes 0",
        "queue_qos0_messages false",
        f"persistence {'true' if persistence else 'false'}",
        f"persistence_location {workdir}/",
        f"autosave_interval {autosave_interval_s}",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
    ]
    return "\n".join(lines) + "\n"


def start_mosquitto(
    *,
    port: int | None = None,
    workdir: Path | None = None,
    persistence: bool = False,
    autosave_interval_s: int = 1,
    max_queued_messages: int = 1_000_000,
    max_inflight_messages: int = 0,
    extra_config: tuple[str, ...] = (),
    tls: ListenerTls | None = None,
    probe: ssl.SSLContext | None = None,
) -> ServerProcess:
    """Start ``mosquitto`` on a free loopback port and wait until it answers CONNECT.

    Restart it with :meth:`ServerProcess.restart` (same port, same ``workdir``: with
    ``persistence`` the sessions and their queued messages survive a graceful restart).
    ``extra_config`` lines go at the end of its configuration (another listener, say).
    With ``tls`` the listener is secured (see :func:`mosquitto_config`) and ``probe``, a
    client TLS context with a certificate of the campus CA, is what the readiness ping
    connects with.
    """
    if tls is not None and probe is None:
        raise ServerError("a secured Mosquitto needs a probe TLS context for its readiness ping")
    find_binary("mosquitto")  # before writing anything
    port = port or free_port()
    workdir = workdir or Path(tempfile.mkdtemp(prefix="sg-mosquitto-"))
    conf = workdir / "mosquitto.conf"
    conf.write_text(
        mosquitto_config(
            port,
            workdir,
            persistence=persistence,
            autosave_interval_s=autosave_interval_s,
            max_queued_messages=max_queued_messages,
            max_inflight_messages=max_inflight_messages,
            tls=tls,
        )
        + "".join(f"{line}\n" for line in extra_config)
    )
    return start_mosquitto_conf(conf, port=port, probe=probe)


def start_mosquitto_conf(
    conf: Path, *, port: int, probe: ssl.SSLContext | None = None
) -> ServerProcess:
    """Start ``mosquitto -c conf``, a configuration the caller wrote whose listener is on
    127.0.0.1:``port``, in ``conf``'s folder, and wait until it answers CONNECT (over TLS
    with ``probe``, a client context, when given)."""
    argv = [find_binary("mosquitto"), "-c", str(conf)]
    workdir = conf.parent
    server = ServerProcess(
        "mosquitto", "127.0.0.1", port, _spawn(argv, workdir), workdir, argv, tls=probe
    )
    _wait_ready(server, 10.0)
    return server


APPENDFSYNC = ("always", "everysec", "no")


REDIS_DATABASES = 64  # a test session hands each module a database of its own


def start_redis(
    *,
    port: int | None = None,
    workdir: Path | None = None,
    appendonly: bool = False,
    appendfsync: str = "everysec",
    extra_args: tuple[str, ...] = (),
) -> ServerProcess:
    """Start ``redis-server`` on a free loopback port and wait until it answers PING.

    With ``appendonly`` every write goes to an append-only file in ``workdir``, flushed to
    disk per ``appendfsync``: ``always`` (each write; nothing acknowledged is lost, even to
    a power cut), ``everysec`` (up to a second of writes lost to a power cut; none to a
    crash of Redis alone, since the file is in the OS cache) or ``no``. Restart it with
    :meth:`ServerProcess.restart`: the same port and ``workdir``, so it reloads the file.
    ``extra_args`` go at the end of its command line (``("--replicaof", host, port)``, say).
    """
    if appendfsync not in APPENDFSYNC:
        raise ServerError(f"appendfsync {appendfsync!r} is not one of {', '.join(APPENDFSYNC)}")
    binary = find_binary("redis-server")
    port = port or free_port()
    workdir = workdir or Path(tempfile.mkdtemp(prefix="sg-redis-"))
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--databases",
        str(REDIS_DATABASES),
        "--appendonly",
        "yes" if appendonly else "no",
        "--appendfsync",
        appendfsync,
        "--dir",
        str(workdir),
        "--protected-mode",
        "no",
        *extra_args,
    ]
    server = ServerProcess("redis", "127.0.0.1", port, _spawn(argv, workdir), workdir, argv)
    _wait_ready(server, 10.0)
    return server


def start_sentinel(
    master_port: int,
    *,
    service: str = "mymaster",
    quorum: int = 2,
    down_after_ms: int = 1000,
    failover_timeout_ms: int = 3000,
    port: int | None = None,
    workdir: Path | None = None,
) -> ServerProcess:
    """Start a Redis Sentinel on a free loopback port, watching the master on
    127.0.0.1:``master_port`` as ``service`` (it finds the replicas and the other sentinels
    from there), and wait until it answers PING. A master unreachable for ``down_after_ms``
    is down for this sentinel; ``quorum`` sentinels agreeing start a failover, retried after
    ``failover_timeout_ms``. ``redis-sentinel`` is used when installed (Debian's package of
    that name), else ``redis-server --sentinel``. Sentinel rewrites its configuration file,
    which lives in ``workdir``."""
    port = port or free_port()
    workdir = workdir or Path(tempfile.mkdtemp(prefix="sg-sentinel-"))
    conf = workdir / "sentinel.conf"
    conf.write_text(
        "\n".join(
            [
                f"port {port}",
                "bind 127.0.0.1",
                "protected-mode no",
                f"dir {workdir}",
                f"sentinel monitor {service} 127.0.0.1 {master_port} {quorum}",
                f"sentinel down-after-milliseconds {service} {down_after_ms}",
                f"sentinel failover-timeout {service} {failover_timeout_ms}",
                f"sentinel parallel-syncs {service} 1",
            ]
        )
        + "\n"
    )
    try:
        argv = [find_binary("redis-sentinel"), str(conf)]
    except ServerError:
        argv = [find_binary("redis-server"), str(conf), "--sentinel"]
    # "redis": it answers the readiness PING as a Redis server does.
    server = ServerProcess("redis", "127.0.0.1", port, _spawn(argv, workdir), workdir, argv)
    _wait_ready(server, 10.0)
    return server


@contextlib.contextmanager
def running(server: ServerProcess) -> Iterator[ServerProcess]:
    """Stop ``server`` when the block ends, whatever happens inside it."""
    try:
        yield server
    finally:
        server.stop()
        if os.environ.get("SLUICEGATE_KEEP_SERVER_DIRS") is None:
            shutil.rmtree(server.workdir, ignore_errors=True)
