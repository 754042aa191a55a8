"""Who hears what, and who waits for which ack, on one MQTT connection: the subscriptions
a transport routes arriving messages by (a shared subscription's messages arrive under its
inner filter), what it keeps for them, and the table matching broker acks to waiting
callers. All on the loop thread; no paho here (:mod:`sluicegate.mqtt.bridge` drives it and
does the sending).

:class:`Subscriptions` holds a transport's subscriptions (renewed together after every
reconnect), the subscriptions each topic matches (remembered, for ``MAX_ROUTES`` topics),
and the connection generation, bumped at every connect and disconnect. A QoS ≥ 1 message
that no subscription claims yet (a persistent session delivers queued messages right after
CONNACK, before the role has subscribed again) is parked, unacked, for the first matching
subscription made on the same connection; a new generation drops what is parked, which the
broker still owes. A message of a ``manual_ack`` subscription carries an :class:`AckHandle`
that remembers its generation: an ack after that connection was lost is dropped (and
counted), since the broker redelivers the message on the new connection under a packet id
that may by then name another message.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from sluicegate.topics import matches
from sluicegate.transport import Handler, Message

log = logging.getLogger(__name__)

MAX_ROUTES = 65_536  # topics whose matching subscriptions are remembered (a topic per node)


def matching(topic_filter: str) -> str:
    """The filter messages arrive under: a shared subscription ``$share/group/f`` delivers
    messages whose topics match ``f``."""
    if topic_filter.startswith("$share/"):
        return topic_filter.split("/", 2)[2]
    return topic_filter


@dataclass(frozen=True)
class Subscription:
    topic_filter: str
    qos: int
    handler: Handler
    manual_ack: bool = False
    pattern: str = field(init=False)  # what arriving topics match: the filter sans $share

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", matching(self.topic_filter))

    def matches(self, topic: str) -> bool:
        return matches(self.pattern, topic)


class Packet(Protocol):
    """What the bookkeeping reads of an arriving PUBLISH (paho's ``MQTTMessage``)."""

    @property
    def topic(self) -> str: ...

    @property
    def qos(self) -> int: ...

    @property
    def mid(self) -> int: ...


P = TypeVar("P", bound=Packet)


@dataclass(frozen=True, slots=True)
class AckHandle:
    """What a manual ack needs: the packet id on the connection it came on."""

    owner: object
    generation: int
    mid: int
    qos: int


Convert = Callable[[P, list[Subscription], int], Message]


class Subscriptions(Generic[P]):
    """One transport's subscriptions, and the messages and acks that hang on them."""

    def __init__(self, max_parked: int, convert: Convert[P]) -> None:
        """``max_parked``: the most messages parked at once (the oldest goes beyond it).
        ``convert``: an arriving message, for the subscriptions it goes to, under the
        generation it came in, made our own (and acked unless a handler will)."""
        self._convert = convert
        self._subs: dict[str, Subscription] = {}
        # Topic -> the subscriptions it matches, remembered (emptied whenever _subs changes).
        self._routes: dict[str, list[Subscription]] = {}
        self._max_parked = max_parked
        self.parked: deque[tuple[P, int]] = deque()  # (message, generation)
        # Connection generation: bumped at every connect and disconnect; an ack handle
        # from an earlier generation names a packet id the broker has forgotten.
        self.generation = 0
        self.stale_acks = 0  # acks dropped because their connection was lost

    def add(self, sub: Subscription) -> None:
        """Hold ``sub`` (in place of one with its filter), and hand it the parked messages
        it claims, each at its own turn of the running loop."""
        self._subs = {**self._subs, sub.topic_filter: sub}
        self._routes = {}
        claimed = [p for p in self.parked if sub.matches(p[0].topic)]
        for parked in claimed:
            self.parked.remove(parked)
        loop = asyncio.get_running_loop()
        for msg, generation in claimed:
            loop.call_soon(call, sub.handler, self._convert(msg, [sub], generation))

    def remove(self, topic_filter: str) -> None:
        self._subs = {f: s for f, s in self._subs.items() if f != topic_filter}
        self._routes = {}

    def renewal(self) -> list[tuple[str, int]]:
        """Every subscription's ``(filter, qos)``, to make again on a new connection."""
        return [(s.topic_filter, s.qos) for s in self._subs.values()]

    def route(self, topic: str) -> list[Subscription]:
        """The subscriptions a message on ``topic`` goes to."""
        subs = self._routes.get(topic)
        if subs is None:
            subs = [s for s in self._subs.values() if s.matches(topic)]
            if len(self._routes) >= MAX_ROUTES:
                self._routes.clear()
            self._routes[topic] = subs
        return subs

    def deliver(self, msg: P) -> None:
        """Hand an arriving message to every subscription it matches, or park it."""
        subs = self.route(msg.topic)
        if not subs:
            self.park(msg)
            return
        message = self._convert(msg, subs, self.generation)
        for sub in subs:
            call(sub.handler, message)

    def park(self, msg: P) -> None:
        """Keep an unclaimed QoS ≥ 1 message, unacked, for a subscription still to come."""
        if msg.qos == 0:
            return
        self.parked.append((msg, self.generation))
        if len(self.parked) > self._max_parked:
            dropped, _ = self.parked.popleft()
            log.warning(
                "no subscription claimed a message on %s; left unacked for the broker to "
                "redeliver after a reconnect",
                dropped.topic,
            )

    def new_generation(self) -> None:
        """A connection began or ended: acks of earlier messages are void, and parked
        messages come again from the broker if they are still owed."""
        self.generation += 1
        self.parked.clear()

    def handle(self, msg: P, subs: list[Subscription], generation: int) -> AckHandle | None:
        """The handle a ``manual_ack`` subscription's handler acks ``msg`` with; None when
        it is acked on arrival (or is QoS 0)."""
        if msg.qos > 0 and any(s.manual_ack for s in subs):
            return AckHandle(self, generation, msg.mid, msg.qos)
        return None

    def due(self, handle: object) -> AckHandle | None:
        """The handle to PUBACK now, or None: not one of ours, QoS 0, or (counted in
        ``stale_acks``) from a connection that is gone."""
        if not isinstance(handle, AckHandle) or handle.owner is not self or handle.qos == 0:
            return None
        if handle.generation != self.generation:
            self.stale_acks += 1
            return None
        return handle


def call(handler: Handler, message: Message) -> None:
    try:
        handler(message)
    except Exception:  # a handler's fault stays its own: the next message is served
        log.exception("handler for %s failed; the transport keeps serving", message.topic)


class AckTable:
    """Matches broker acks to the futures of callers that wait for them (all on the loop).

    A caller registers right after handing its packet to paho, and acks are read only when
    the loop next runs, so an ack is never handled before its waiter exists: an ack nobody
    waits for (a publish without ``wait``) is simply dropped.
    """

    def __init__(self) -> None:
        self._waiting: dict[int, asyncio.Future[None]] = {}

    def expect(self, mid: int, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future for the ack of ``mid`` (right after the packet was queued)."""
        fut: asyncio.Future[None] = loop.create_future()
        self._waiting[mid] = fut
        return fut

    def forget(self, mid: int) -> None:
        self._waiting.pop(mid, None)

    def acked(self, mid: int, error: Exception | None) -> None:
        """Record an ack: settle its waiter, if any."""
        fut = self._waiting.pop(mid, None)
        if fut is not None:
            settle(fut, error)

    def fail_all(self, error: Exception | None) -> None:
        """Settle every waiter: on close, or a SUBACK lost with its connection."""
        waiting = list(self._waiting.values())
        self._waiting.clear()
        for fut in waiting:
            settle(fut, error)


def settle(fut: asyncio.Future[None], error: Exception | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
