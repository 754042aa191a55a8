"""What every role needs from MQTT, independent of any client library.

:class:`Message` is our own immutable view of an MQTT v5 application message;
:class:`Transport` is the small protocol the shells are written against. The real
implementation (paho) lives in :mod:`sluicegate.mqtt`; :mod:`sluicegate.memory_transport`
implements the same protocol in memory for the middle tier of tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

UserProperties = tuple[tuple[str, str], ...]
Handler = Callable[["Message"], None]


@dataclass(frozen=True, slots=True)
class Message:
    """An MQTT v5 application message."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    response_topic: str | None = None
    correlation_data: bytes | None = None
    content_type: str | None = None
    user_properties: UserProperties = ()
    message_expiry_s: int | None = None

    def user_property(self, name: str) -> str | None:
        """The first user property called ``name``, or None."""
        for key, value in self.user_properties:
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class Will:
    """The Last Will the broker publishes if a client vanishes without a DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


class Transport(Protocol):
    """Publish, subscribe and connection events; handlers run on the event loop."""

    def publish_nowait(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 0,
        retain: bool = False,
        response_topic: str | None = None,
        correlation_data: bytes | None = None,
        content_type: str | None = None,
        user_properties: UserProperties = (),
    ) -> object:
        """Hand a message to the client now; QoS ≥ 1 is retried by the client until acked."""

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 0,
        retain: bool = False,
        response_topic: str | None = None,
        correlation_data: bytes | None = None,
        content_type: str | None = None,
        user_properties: UserProperties = (),
        wait: bool = False,
    ) -> None:
        """Publish; with ``wait`` and QoS ≥ 1, return once the broker has acked."""

    async def subscribe(self, topic_filter: str, handler: Handler, *, qos: int = 1) -> None:
        """Deliver each matching message to ``handler`` on the loop."""

    def on_connect(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` on the loop after every (re)connect, once subscriptions are renewed."""

    @property
    def connected(self) -> bool: ...
