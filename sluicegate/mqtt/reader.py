"""Reading one MQTT connection's socket for the transport: large reads, packets cut out of
them (:mod:`sluicegate.mqtt.framing`), each QoS 0 or QoS 1 PUBLISH decoded and routed here,
every other packet handed whole to paho (:class:`~sluicegate.mqtt.client.FedClient`), which
reads it as from its socket: acks, CONNACK, PINGRESP, DISCONNECT, QoS 2, and a PUBLISH
that does not decode (paho then finds it malformed and ends the connection, as it would
have). Bytes that cannot be MQTT packets end the connection too; the transport reconnects.

A read asks for 64 KB, or for all a large packet still lacks. Over plain TCP a read that
returned less than it asked for drained the socket (the selector says when more comes).
Over TLS a read returns at most one TLS record, and Mosquitto writes a record for each
packet: a short read says nothing of the records behind it, so the socket is read on
until it has nothing (``SSLWantReadError``), one wake-up taking all that came rather than a
packet each.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable

from sluicegate.mqtt import framing
from sluicegate.mqtt.client import FedClient
from sluicegate.mqtt.framing import Frames, FramingError, Publish

log = logging.getLogger(__name__)

RECV_BYTES = 1 << 16  # what one read of the socket asks for (more for a larger packet)


class SocketReader:
    """Takes in what one client's socket delivers, a burst at a time."""

    def __init__(self, client: FedClient, deliver: Callable[[Publish], None], peer: str) -> None:
        self._client = client
        self._deliver = deliver
        self._peer = peer
        self._frames = Frames()

    def restart(self) -> None:
        """A new connection: it starts from its first byte."""
        self._frames.clear()
        self._client.restart()

    def burst(self, most: int) -> bool:
        """Take in up to ``most`` packets, reading the socket as they run out; whether it
        stopped at ``most`` (more may wait, already read) rather than for want of bytes."""
        frames = self._frames
        drained = False  # the socket held no more than the last read took
        for _ in range(most):
            try:
                packet = frames.next()
            except FramingError as exc:
                self._end(f"the broker sent what is not MQTT: {exc}")
                return False
            if packet is None:
                read = None if drained else self._receive()
                if read is None:
                    return False
                drained = read
                continue
            self._take(*packet)
            if self._client.socket() is None:
                return False  # the connection ended inside paho
        return True

    def _receive(self) -> bool | None:
        """Read what the socket holds into the frames: whether that surely drained it, or
        None when there was nothing (or the connection ended)."""
        sock = self._client.socket()
        if sock is None:
            return None
        size = max(RECV_BYTES, self._frames.wanted)
        try:
            data = sock.recv(size)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except OSError as exc:
            self._end(f"reading the connection failed: {exc}")
            return None
        if not data:  # the broker (or the network) closed it: paho finds it lost
            self._end(None)
            return None
        self._frames.feed(data)
        return len(data) < size and not isinstance(sock, ssl.SSLSocket)

    def _take(self, header: int, body: bytes) -> None:
        if header & 0xF0 == framing.PUBLISH and header & 0x06 != 0x04:  # QoS 0 or 1
            try:
                publish = framing.decode_publish(header, body)
            except ValueError as exc:
                log.warning("malformed PUBLISH from the broker at %s: %s", self._peer, exc)
            else:
                self._deliver(publish)
                return
        self._client.hand(header, body)
        self._client.loop_read()

    def _end(self, why: str | None) -> None:
        """The connection can be read no further: paho's next read finds it lost."""
        if why is not None:
            log.warning("MQTT connection to %s closed: %s", self._peer, why)
        self._client.hand_end()
        self._client.loop_read()
