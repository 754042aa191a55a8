"""A node's own identity at start-up and while it serves: proven, and never served twice.

Before a node serves, it checks that it will connect as itself (TLS with a client
certificate whose CN is its node id, unless ``[mqtt] plaintext`` asks for the debugging
mode), takes its state directory's lock (a second process on the same machine refuses at
once), and claims its identity on the campus (:class:`IdentityGuard`):

- Mosquitto lets one connection per identity exist (``use_username_as_clientid``); a second
  process with the same certificate takes over the first one's connection, and the first
  reconnects a second later, taking it back. So a newcomer that finds its own retained
  status ``online`` under another process instance waits ``grace_s`` before it serves: if
  its connection is taken from it meanwhile, another process is alive and it refuses to
  start, saying which (:class:`~sluicegate.errors.IdentityInUse`). A node that crashed left
  ``offline`` (its Last Will), and one stopped cleanly said so itself: no wait then.
- While serving, a status of another instance of the same node is decided by seniority
  (:func:`rival`): the instance started first keeps serving and announces itself again; the
  later one is fenced: it stops serving and the process exits with :data:`EXIT_IN_USE`
  (which the systemd units do not restart).

The decisions (:func:`rival`, :func:`check_client_identity`) are pure; the guard is the thin
shell over the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO, Literal

from pydantic import ValidationError

from sluicegate import topics, wire
from sluicegate.config import MqttSettings
from sluicegate.errors import ConfigError, IdentityError, IdentityInUse
from sluicegate.instance import Instance, this_process
from sluicegate.transport import Message, Transport

log = logging.getLogger(__name__)

PROBE_WAIT_S = 5.0  # for the probe's echo, which marks the end of the retained status
EXIT_IN_USE = 3  # the process exit status when another process serves this identity


def instance_of(status: wire.NodeStatus) -> Instance | None:
    if status.instance is None or status.since is None:
        return None
    return Instance(status.instance, status.since, status.host or "?")


Standing = Literal["self", "senior", "junior", "gone"]


def rival(me: Instance, status: wire.NodeStatus) -> Standing:
    """What a status message of our own node says about us: our own (``self``), another
    live instance started before us (``senior``: we must stop) or after us (``junior``:
    it must stop), or none (``gone``: offline, or a status without an instance)."""
    other = instance_of(status)
    if other is None or status.state != "online":
        return "gone"
    if other.id == me.id:
        return "self"
    return "senior" if (other.since, other.id) < (me.since, me.id) else "junior"


def check_client_identity(mqtt: MqttSettings, node: str, cert_name: str | None) -> None:
    """The node connects as itself: TLS with its own certificate (CN ``node``), unless the
    configuration says ``plaintext`` (debugging). ``cert_name`` is the CN of
    ``tls_cert_file`` (None when no certificate is configured)."""
    if mqtt.tls_ca_file is None:
        if mqtt.plaintext:
            log.warning(
                "node %s connects without TLS or a client certificate ([mqtt] plaintext): "
                "anyone on the network can read and forge its messages; debugging only",
                node,
            )
            return
        raise ConfigError(
            f"node {node} has no TLS configured: set [mqtt] tls_ca_file, tls_cert_file and "
            "tls_key_file (written by 'sluicegate edge install --join TOKEN'), or "
            "[mqtt] plaintext = true to run without identity, for debugging only"
        )
    if mqtt.tls_cert_file is None or mqtt.tls_key_file is None:
        raise ConfigError(
            f"node {node} has [mqtt] tls_ca_file but no client certificate: set "
            "tls_cert_file and tls_key_file (its own certificate and key from enrollment)"
        )
    if cert_name != node:
        raise ConfigError(
            f"[mqtt] tls_cert_file {mqtt.tls_cert_file} is the certificate of "
            f"{cert_name!r}, but this node is {node!r}: a node connects only as itself"
        )


def lock_path(state_dir: Path, node: str) -> Path:
    """The file a serving node holds locked (``sluicegate doctor`` looks at it too)."""
    return state_dir / f"{node}.lock"


@contextlib.contextmanager
def node_lock(state_dir: Path, node: str) -> Iterator[None]:
    """Hold ``state_dir``'s lock while the node serves: a second process using the same
    state (the same outbox) on this machine refuses to start."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = lock_path(state_dir, node)
    handle: IO[str] = path.open("a+")
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise IdentityInUse(
                f"node {node}: {holder} already serves from {state_dir} ({path} is locked); "
                "stop it first, or give this process its own identity and state directory"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} ({this_process().describe()})\n")
        handle.flush()
        yield
    finally:
        handle.close()


class IdentityGuard:
    """Claims a node's identity before it serves and fences it if another instance,
    started earlier, turns up."""

    def __init__(
        self,
        transport: Transport,
        *,
        node: str,
        status_topic: str,
        reannounce: Callable[[], object],
        grace_s: float,
        me: Instance | None = None,
    ) -> None:
        self._transport = transport
        self._node = node
        self._topic = status_topic
        self._reannounce = reannounce
        self._grace_s = grace_s
        self.me = me or this_process()
        self.fenced = asyncio.Event()
        self.waiting = asyncio.Event()  # set while it waits to see whether a holder is alive
        self.reason = ""
        self._suspect: Instance | None = None
        self._lost = asyncio.Event()
        self._claimed = False

    async def claim(self) -> None:
        """Return once this process may serve; raise IdentityInUse if another does."""
        self._transport.on_disconnect(self._lost.set)
        await self._status_seen()
        if self._suspect is not None and not self._lost.is_set():
            log.warning(
                "node %s: its status says another process serves it (%s); waiting %.0f s to "
                "see whether it is alive",
                self._node,
                self._suspect.describe(),
                self._grace_s,
            )
            self.waiting.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), self._grace_s)
        if self._suspect is not None and self._lost.is_set():
            raise IdentityInUse(
                f"node {self._node} is already served by {self._suspect.describe()}: it took "
                "this connection back. Stop that process first, or give this one its own "
                "identity; two processes with one identity would answer the same jobs"
            )
        self._claimed = True

    async def _status_seen(self) -> None:
        """Subscribe to the node's status and return once its retained copy, if there is
        one, has arrived: Mosquitto sends a subscription's retained messages before what
        is published after it, so a message of our own through the node's probe topic,
        once back, says nothing more is coming."""
        probe = topics.node_probe(self._node)
        marker = f"claim {self.me.id} {time.monotonic_ns()}".encode()
        echoed = asyncio.Event()

        def on_probe(msg: Message) -> None:
            if msg.payload == marker:
                echoed.set()

        await self._transport.subscribe(probe, on_probe, qos=1)
        await self._transport.subscribe(self._topic, self._on_status, qos=1)
        self._transport.publish_nowait(Message(probe, marker, qos=1))
        try:
            await asyncio.wait_for(echoed.wait(), PROBE_WAIT_S)
        except TimeoutError:
            log.warning(
                "node %s: its probe topic %s did not echo within %.0f s (an ACL generated "
                "before probe topics existed? regenerate it with 'sluicegate policy acl')",
                self._node,
                probe,
                PROBE_WAIT_S,
            )
        finally:
            await self._transport.unsubscribe(probe)

    def _on_status(self, msg: Message) -> None:
        if not msg.payload:
            return
        try:
            status = wire.NodeStatus.model_validate_json(msg.payload)
        except ValidationError:
            return
        if status.node != self._node:
            return
        standing = rival(self.me, status)
        other = instance_of(status)
        if not self._claimed:
            self._suspect = other if standing in ("senior", "junior") else None
            return
        if standing == "junior":  # it must stop; make sure it sees us
            self._reannounce()
        elif standing == "senior" and other is not None and not self.fenced.is_set():
            self.reason = (
                f"node {self._node} is also served by {other.describe()}, which started "
                f"first; this process ({self.me.describe()}) stops serving"
            )
            log.error("fenced: %s", self.reason)
            self.fenced.set()


async def claim(
    transport: Transport, mqtt: MqttSettings, *, node: str, status_topic: str, online: bytes
) -> IdentityGuard:
    """Claim ``node``'s identity on a connected transport (``online``: the node's retained
    status document, published again if a newer instance shows up); IdentityInUse if
    another process holds it."""
    guard = IdentityGuard(
        transport,
        node=node,
        status_topic=status_topic,
        reannounce=lambda: transport.publish_nowait(
            Message(status_topic, online, qos=1, retain=True)
        ),
        grace_s=grace_for(mqtt),
    )
    await guard.claim()
    return guard


async def serve_until_fenced(
    stop: asyncio.Event,
    fenced: asyncio.Event,
    reason: Callable[[], str],
    run: Callable[[asyncio.Event], Awaitable[object]],
) -> None:
    """Run ``run(until)`` until ``stop`` or ``fenced`` is set; after ``fenced``,
    IdentityInUse with ``reason()``."""
    until = asyncio.Event()

    async def watch() -> None:
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(fenced.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        until.set()

    watcher = asyncio.ensure_future(watch())
    try:
        await run(until)
    finally:
        watcher.cancel()
    if fenced.is_set():
        raise IdentityInUse(reason())


async def serve_guarded(
    guard: IdentityGuard, stop: asyncio.Event, run: Callable[[asyncio.Event], Awaitable[object]]
) -> None:
    """Run ``run(until)`` until ``stop`` or until the guard fences this process (then
    IdentityInUse)."""
    await serve_until_fenced(stop, guard.fenced, lambda: guard.reason, run)


def grace_for(mqtt: MqttSettings) -> float:
    """How long a newcomer waits for a live holder of its identity to take its connection
    back: the holder reconnects after ``reconnect_min_s``, plus time to connect."""
    return 2.0 * mqtt.reconnect_min_s + 2.0


def mqtt_client_id(mqtt: MqttSettings, node: str, fallback: str) -> str:
    """The client id a node connects with: its node id under TLS (Mosquitto makes the
    certificate's CN the client id anyway), ``fallback`` in plaintext mode."""
    return node if mqtt.tls_cert_file is not None else fallback


def prepare(mqtt: MqttSettings, node: str) -> None:
    """Refuse to start unless this node will connect as itself (see the module)."""
    check_client_identity(mqtt, node, certificate_name(mqtt))


def certificate_name(mqtt: MqttSettings) -> str | None:
    """The CN of ``[mqtt] tls_cert_file``, or None when there is none."""
    if mqtt.tls_cert_file is None:
        return None
    from sluicegate import pki

    try:
        return pki.common_name(pki.read_cert(mqtt.tls_cert_file))
    except IdentityError as exc:
        raise ConfigError(f"[mqtt] tls_cert_file: {exc}") from exc
