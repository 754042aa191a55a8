"""An in-memory stand-in for the MQTT broker and transport, for the in-memory test tier.

Several :class:`MemoryTransport` objects attached to one :class:`MemoryBroker` see each
other's publishes with MQTT filter semantics and retained messages. Delivery is
asynchronous (scheduled on the loop) like the real transport, so code that works here
does not silently rely on re-entrancy. It is not a broker: no QoS, sessions or wills.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from sluicegate.topics import matches
from sluicegate.transport import Handler, Message, UserProperties


@dataclass
class MemoryBroker:
    transports: list[MemoryTransport] = field(default_factory=list)
    retained: dict[str, Message] = field(default_factory=dict)
    log: list[Message] = field(default_factory=list)

    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

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
        loop = asyncio.get_running_loop()
        for transport in self.transports:
            for topic_filter, handler in transport.subscriptions.items():
                if matches(topic_filter, message.topic):
                    loop.call_soon(handler, message)


class MemoryTransport:
    """Implements :class:`sluicegate.mqtt.Transport` against a :class:`MemoryBroker`."""

    def __init__(self, broker: MemoryBroker) -> None:
        self._broker = broker
        self.subscriptions: dict[str, Handler] = {}
        self._hooks: list[Callable[[], None]] = []
        broker.transports.append(self)

    @property
    def connected(self) -> bool:
        return True

    def on_connect(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)

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
    ) -> None:
        self._broker.route(
            Message(
                topic,
                payload,
                qos,
                retain,
                response_topic,
                correlation_data,
                content_type,
                user_properties,
            )
        )

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
        self.publish_nowait(
            topic,
            payload,
            qos=qos,
            retain=retain,
            response_topic=response_topic,
            correlation_data=correlation_data,
            content_type=content_type,
            user_properties=user_properties,
        )

    async def subscribe(self, topic_filter: str, handler: Handler, *, qos: int = 1) -> None:
        self.subscriptions[topic_filter] = handler
        loop = asyncio.get_running_loop()
        for message in self._broker.retained.values():
            if matches(topic_filter, message.topic):
                loop.call_soon(handler, message)
