"""Who hears what, and who waits for which ack, on one MQTT connection: the subscriptions
a transport routes arriving messages by (a shared subscription's messages arrive under its
inner filter) and the table matching broker acks to waiting callers. All on the loop
thread; no paho here (:mod:`sluicegate.mqtt.bridge` drives it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sluicegate.topics import matches
from sluicegate.transport import Handler


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
