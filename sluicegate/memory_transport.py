"""An in-memory stand-in for the MQTT broker and transport, for the in-memory test tier.

Several :class:`MemoryTransport` objects attached to one :class:`MemoryBroker` see each
other's publishes with MQTT filter semantics and retained messages. Delivery is
asynchronous (scheduled on the loop) like the real transport, so code that works here
does not silently rely on re-entrancy.

It models just enough of sessions and acknowledgement to test crash recovery honestly:

* A transport with a ``client_id`` and ``persistent=True`` has a session on the broker that
  outlives it. :meth:`MemoryTransport.crash` kills the transport (nothing more goes in or
  out, acks and publishes through it are void); while its session is offline, QoS ≥ 1
  messages matching the session's subscriptions are queued. A new transport with the same
  client id resumes the session: messages it never acked, then the queued ones, are handed
  to its matching subscriptions as it makes them (as the real transport parks what arrives
  before its roles subscribe again).
* A ``manual_ack`` subscription's QoS ≥ 1 messages stay owed to the session until
  :meth:`MemoryTransport.ack`; other subscriptions are acked on delivery. What was delivered
  and never acked comes again with ``dup`` set, as a broker marks a redelivery.
* With :attr:`MemoryBroker.hold_pubacks`, ``publish(wait=True)`` returns only once the test
  calls :meth:`MemoryBroker.release_pubacks` (the message itself is routed at once), so a
  crash between a publish and its PUBACK can be staged.

It is not a broker: no QoS 2, no wills, no session expiry, no message ordering across
sessions beyond the loop's own.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sluicegate.errors import TransportError
from sluicegate.topics import matches
from sluicegate.transport import Handler, Message


@dataclass
class _Sub:
    handler: Handler
    qos: int
    manual_ack: bool


@dataclass
class _Session:
    client_id: str
    persistent: bool
    filters: dict[str, int] = field(default_factory=dict)  # kept by the broker: filter -> QoS
    unacked: dict[int, Message] = field(default_factory=dict)  # ack handle -> message
    queued: list[Message] = field(default_factory=list)  # arrived while offline
    transport: MemoryTransport | None = None

    def wants(self, topic: str) -> int | None:
        """The highest QoS of this session's subscriptions matching ``topic``, or None."""
        levels = [q for f, q in self.filters.items() if matches(f, topic)]
        return max(levels) if levels else None


@dataclass
class MemoryBroker:
    transports: list[MemoryTransport] = field(default_factory=list)
    retained: dict[str, Message] = field(default_factory=dict)
    log: list[Message] = field(default_factory=list)
    sessions: dict[str, _Session] = field(default_factory=dict)
    hold_pubacks: bool = False

    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _handles: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _held: list[tuple[MemoryTransport, asyncio.Future[None]]] = field(default_factory=list)

    async def wait_for(self, predicate: Callable[[Message], bool], timeout: float = 5.0) -> Message:
        """The first logged message matching ``predicate``, waiting up to ``timeout``."""
        async with asyncio.timeout(timeout):
            while True:
                for message in self.log:
                    if predicate(message):
                        return message
                self._arrived.clear()
                await self._arrived.wait()

    def route(self, message: Message) -> None:
        self.log.append(message)
        self._arrived.set()
        if message.retain:
            self.retained[message.topic] = message
        for transport in list(self.transports):
            transport._receive(message)
        for session in self.sessions.values():
            if session.transport is None:
                qos = session.wants(message.topic)
                if qos is not None and min(qos, message.qos) > 0:
                    session.queued.append(replace(message, qos=min(qos, message.qos)))

    def release_pubacks(self) -> int:
        """Send every held PUBACK (see ``hold_pubacks``); returns how many."""
        held, self._held = self._held, []
        for _transport, fut in held:
            if not fut.done():
                fut.set_result(None)
        return len(held)

    def _hold(self, transport: MemoryTransport) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.append((transport, fut))
        return fut

    def _drop(self, transport: MemoryTransport) -> None:
        if transport in self.transports:
            self.transports.remove(transport)
        lost = TransportError("connection lost before the broker acked")
        for owner, fut in self._held:
            if owner is transport and not fut.done():
                fut.set_exception(lost)
        self._held = [(o, f) for o, f in self._held if o is not transport]


class MemoryTransport:
    """Implements :class:`sluicegate.transport.Transport` against a :class:`MemoryBroker`."""

    def __init__(
        self, broker: MemoryBroker, *, client_id: str | None = None, persistent: bool = False
    ) -> None:
        self._broker = broker
        self.subscriptions: dict[str, Handler] = {}
        self._subs: dict[str, _Sub] = {}
        self._hooks: list[Callable[[], None]] = []
        self._lost_hooks: list[Callable[[], None]] = []
        self._alive = True
        self._pending: list[Message] = []  # owed by a resumed session, not yet claimed
        client_id = client_id or f"mem-{next(broker._handles)}"
        self.client_id = client_id
        old = broker.sessions.get(client_id)
        if old is not None and old.transport is not None:
            old.transport.crash()  # session takeover, as a broker does for a duplicate id
            old = broker.sessions.get(client_id)
        if old is not None and persistent:
            self._session = old
            again = [replace(m, dup=True) for m in old.unacked.values()]
            self._pending = [*again, *old.queued]
            old.unacked.clear()
            old.queued.clear()
        else:
            self._session = _Session(client_id, persistent)
            broker.sessions[client_id] = self._session
        self._session.transport = self
        broker.transports.append(self)

    @property
    def connected(self) -> bool:
        return self._alive

    def on_connect(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)

    def on_disconnect(self, hook: Callable[[], None]) -> None:
        self._lost_hooks.append(hook)

    def crash(self) -> None:
        """The client dies without a DISCONNECT: nothing more is delivered to or sent by it;
        a persistent session keeps what it was owed for the next transport of its id."""
        if not self._alive:
            return
        self._alive = False
        for hook in self._lost_hooks:
            hook()
        self._broker._drop(self)
        session = self._session
        session.transport = None
        if session.persistent:
            # Still owed: delivered but unacked (already in ``unacked``), and never claimed.
            session.queued[:0] = self._pending
        elif self._broker.sessions.get(session.client_id) is session:
            del self._broker.sessions[session.client_id]
        self._pending = []

    def publish_nowait(self, message: Message) -> None:
        if not self._alive:
            return  # the process is gone: nothing it "sends" leaves it
        # What is sent is the message's value: no delivery metadata of an earlier hop.
        self._broker.route(replace(message, ack_handle=None, dup=False))

    async def publish(self, message: Message, *, wait: bool = False) -> None:
        if not self._alive:
            raise TransportError(f"transport {self.client_id} is gone")
        self.publish_nowait(message)
        if wait and message.qos > 0 and self._broker.hold_pubacks:
            await self._broker._hold(self)

    async def unsubscribe(self, topic_filter: str) -> None:
        self._subs.pop(topic_filter, None)
        self.subscriptions.pop(topic_filter, None)
        self._session.filters.pop(topic_filter, None)

    async def subscribe(
        self, topic_filter: str, handler: Handler, *, qos: int = 1, manual_ack: bool = False
    ) -> None:
        sub = _Sub(handler, qos, manual_ack)
        self._subs[topic_filter] = sub
        self.subscriptions[topic_filter] = handler
        self._session.filters[topic_filter] = qos
        for message in self._broker.retained.values():
            if matches(topic_filter, message.topic):
                self._schedule(sub, message)
        claimed = [m for m in self._pending if matches(topic_filter, m.topic)]
        self._pending = [m for m in self._pending if not matches(topic_filter, m.topic)]
        for message in claimed:
            self._schedule(sub, message)

    def ack(self, message: Message) -> None:
        if self._alive and isinstance(message.ack_handle, int):
            self._session.unacked.pop(message.ack_handle, None)

    @property
    def unacked(self) -> list[Message]:
        """Messages this session was given on manual-ack subscriptions and has not acked."""
        return list(self._session.unacked.values())

    # -- broker side --------------------------------------------------------------------------

    def _receive(self, message: Message) -> None:
        subs = [s for f, s in self._subs.items() if matches(f, message.topic)]
        for sub in subs:
            self._schedule(sub, message)
        if not subs:
            qos = self._session.wants(message.topic)
            if qos is not None and min(qos, message.qos) > 0:
                self._pending.append(replace(message, qos=min(qos, message.qos)))

    def _schedule(self, sub: _Sub, message: Message) -> None:
        qos = min(sub.qos, message.qos)
        handle = None
        if sub.manual_ack and qos > 0:
            handle = next(self._broker._handles)
            self._session.unacked[handle] = message
        delivered = replace(message, qos=qos, ack_handle=handle)
        asyncio.get_running_loop().call_soon(self._deliver, sub.handler, delivered)

    def _deliver(self, handler: Handler, message: Message) -> None:
        if self._alive:
            handler(message)
