"""The socket of one MQTT connection as the event loop watches it, for the transport: a
read when it is readable (a burst at a time, :mod:`sluicegate.mqtt.reader`), paho's writes
while it has packets queued, the read gap, and every call into paho on the loop.

A burst of ``READ_BURST`` packets is handed to its handlers in one go (one placement
batch, one Redis round trip), and what it left already read waits for the loop's next
turn, not for the socket. paho's callback lock is not reentrant, so a publish made inside
a call into paho (a handler's reply, an ack) is written right after that call ends, and
one made on the loop outside it is written at once. With a read gap (the broker's), a read
that drained the socket stops the loop watching it for that long: what comes meanwhile
waits in the kernel, and the next read takes all of it, dozens of small messages to a
wake-up instead of one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sluicegate.mqtt.client import FedClient
from sluicegate.mqtt.reader import SocketReader

READ_BURST = 64  # packets taken in per turn of the loop, at most


class SocketWatch:
    """The loop's watch on one client's socket, from connect to the connection's end."""

    def __init__(self, client: FedClient, reader: SocketReader, read_gap_s: float) -> None:
        self._client = client
        self._reader = reader
        self._read_gap_s = read_gap_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fd: int | None = None  # paho's socket, while the loop watches it
        self._gap: asyncio.TimerHandle | None = None  # the read gap under way
        self._resume = False  # a burst's continuation waits for the loop's next turn
        self._in_paho = False  # inside a call into paho, whose callbacks may publish
        self._published = False  # a handler published during this call into paho

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the socket paho has just connected: read when readable, and write what
        paho queued meanwhile (the CONNECT at least)."""
        sock = self._client.socket()
        if sock is None:
            return
        self._loop = loop
        self.fd = sock.fileno()
        self._reader.restart()
        loop.add_reader(self.fd, self._readable)
        loop.add_writer(self.fd, self._writable)

    def unwatch(self) -> None:
        """The connection is over: the loop lets go of its socket."""
        fd, self.fd = self.fd, None
        loop = self._loop
        if self._gap is not None:
            self._gap.cancel()
            self._gap = None
        if fd is not None and loop is not None and not loop.is_closed():
            loop.remove_reader(fd)
            loop.remove_writer(fd)

    def paho(self, call: Callable[[], object]) -> None:
        """Call into paho; a publish its callbacks make waits for the end of the call."""
        self._in_paho = True
        try:
            call()
        finally:
            self._in_paho = False

    def published(self, *, on_loop: bool) -> None:
        """paho has queued a packet: written right after the call into paho under way, or
        at once from the loop (not after its next poll), or by the writer's watch."""
        if self._in_paho:
            self._published = True
        elif on_loop and self.fd is not None:
            self.paho(self._client.loop_write)

    def want_write(self, wanted: bool) -> None:
        """paho has packets queued (or none left): watch the socket for room to write."""
        loop = self._loop
        if self.fd is None or loop is None:
            return
        if wanted:
            loop.add_writer(self.fd, self._writable)
        else:
            loop.remove_writer(self.fd)

    def _writable(self) -> None:
        self.paho(self._client.loop_write)

    def _readable(self) -> None:
        """Take in what the socket holds, up to ``READ_BURST`` packets, then write what the
        handlers published meanwhile (replies, acks) right after, not at the next poll."""
        self._resume = False
        if self.fd is None:
            return  # a continuation that outlived its connection
        self._in_paho = True  # a handler's publish waits for the end of the burst
        try:
            full = self._reader.burst(READ_BURST)
        finally:
            self._in_paho = False
        if full and not self._resume and self._loop is not None:
            self._resume = True
            self._loop.call_soon(self._readable)
        elif not full and self._read_gap_s > 0.0:
            self._pause_reading()
        if self._published:
            self._published = False
            if self.fd is not None:
                self.paho(self._client.loop_write)

    def _pause_reading(self) -> None:
        """The socket is drained: look at it again only after the read gap."""
        loop = self._loop
        if self.fd is None or loop is None or self._gap is not None:
            return
        loop.remove_reader(self.fd)
        self._gap = loop.call_later(self._read_gap_s, self._watch_again)

    def _watch_again(self) -> None:
        """The read gap is over: the next byte (or those already waiting) wakes a read."""
        self._gap = None
        if self.fd is not None and self._loop is not None:
            self._loop.add_reader(self.fd, self._readable)
