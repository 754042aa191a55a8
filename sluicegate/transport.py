"""What every role needs from MQTT, independent of any client library.

:class:`Message` is our own immutable view of an MQTT v5 application message;
:class:`Transport` is the small protocol the shells are written against. The real
implementation (paho) lives in :mod:`sluicegate.mqtt`; :mod:`sluicegate.memory_transport`
implements the same protocol in memory for the middle tier of tests.

Acknowledgement: a subscription is acknowledged automatically (the PUBACK leaves as soon as
the message is handed over) unless it is made with ``manual_ack=True``; then the handler
owns the PUBACK and calls :meth:`Transport.ack` once it has made the message durable. A
message never acked is redelivered by the broker when the same persistent session
reconnects, which is how "accepted only once durable" survives a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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
    # What the transport needs to acknowledge this very delivery (manual-ack subscriptions
    # only); opaque to everyone else and no part of the message's value.
    ack_handle: object = field(default=None, compare=False, repr=False)
    # The broker delivers this message again (it was sent to this session before and not
    # acked): delivery metadata, no part of the message's value either.
    dup: bool = field(default=False, compare=False)

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

    def publish_nowait(self, message: Message) -> object:
        """Hand ``message`` to the client now; QoS ≥ 1 is retried by the client until acked."""

    async def publish(self, message: Message, *, wait: bool = False) -> None:
        """Publish ``message``; with ``wait`` and QoS ≥ 1, return once the broker has acked."""

    async def subscribe(
        self, topic_filter: str, handler: Handler, *, qos: int = 1, manual_ack: bool = False
    ) -> None:
        """Deliver each matching message to ``handler`` on the loop; with ``manual_ack`` the
        handler must call :meth:`ack` for each message (QoS ≥ 1) once it is safe to."""

    async def unsubscribe(self, topic_filter: str) -> None:
        """Stop delivering messages matching ``topic_filter``."""

    def ack(self, message: Message) -> None:
        """Acknowledge a message from a manual-ack subscription; a no-op for QoS 0, for a
        message of an automatically acked subscription, and for one that arrived over a
        connection since lost (the broker redelivers it on the new one)."""

    def on_connect(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` on the loop after every (re)connect, once subscriptions are renewed."""

    def on_disconnect(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` on the loop whenever an established connection is lost."""

    @property
    def connected(self) -> bool: ...
