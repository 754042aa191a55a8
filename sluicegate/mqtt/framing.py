"""MQTT packets cut out of the bytes a connection delivers, and a received PUBLISH decoded
in one pass (MQTT v5, sections 2.1 and 3.3). No I/O and no paho here.

:class:`Frames` keeps what the socket delivered and hands out whole packets: the fixed
header's first byte and the body (variable header and payload). The transport reads the socket in
large chunks and cuts packets here (paho reads a packet's first byte, each byte of its
length and its body with a ``recv`` each, and builds a ``MQTTMessage`` with two locks and
a condition for every message received). A remaining length longer than four bytes is a
:class:`FramingError`: the connection cannot be read further.

:func:`decode_publish` reads a PUBLISH body into :class:`Publish`: the topic, the packet
id (QoS ≥ 1), the properties (:func:`~sluicegate.mqtt.wire.decode_publish_properties`)
and the payload, copied once; what is malformed raises ``ValueError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluicegate.mqtt.wire import PublishProperties, decode_publish_properties
from sluicegate.transport import Message

PUBLISH = 0x30
COMPACT_AT = 1 << 16  # consumed bytes dropped from the buffer's front past this many


class FramingError(Exception):
    """The bytes are not MQTT packets: the connection must be closed."""


class Frames:
    """The packets in what one connection delivered, in order."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # where the next packet starts
        self._missing = 0  # bytes the packet at _pos still lacks, when known

    def feed(self, data: bytes) -> None:
        """Add what the socket delivered."""
        if self._pos >= COMPACT_AT or self._pos == len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def clear(self) -> None:
        """Forget everything (a new connection starts from its first byte)."""
        self._buf = bytearray()
        self._pos = self._missing = 0

    @property
    def wanted(self) -> int:
        """Bytes the packet at the front still lacks (0: none known to be missing)."""
        return self._missing

    def next(self) -> tuple[int, bytes] | None:
        """The next whole packet, ``(first byte, body)``, or None until more arrives."""
        buf, pos = self._buf, self._pos
        have = len(buf) - pos
        if have < 2:
            return None
        length = mult = 0
        at = pos + 1
        while True:
            if at - pos > 4:
                raise FramingError("a packet's remaining length runs past four bytes")
            if at >= len(buf):
                return None
            byte = buf[at]
            length += (byte & 0x7F) << mult
            mult += 7
            at += 1
            if not byte & 0x80:
                break
        end = at + length
        if end > len(buf):
            self._missing = end - len(buf)
            return None
        self._missing = 0
        self._pos = end
        return buf[pos], bytes(memoryview(buf)[at:end])


@dataclass(frozen=True, slots=True)
class Publish:
    """A received PUBLISH, decoded (what routing and acks read of it, and the rest)."""

    topic: str
    qos: int
    mid: int
    retain: bool
    dup: bool
    properties: PublishProperties
    payload: bytes

    def message(self, ack_handle: object = None) -> Message:
        """Our own :class:`Message` of it."""
        props = self.properties
        return Message(
            topic=self.topic,
            payload=self.payload,
            qos=self.qos,
            retain=self.retain,
            response_topic=props.response_topic,
            correlation_data=props.correlation_data,
            content_type=props.content_type,
            user_properties=props.user_properties,
            message_expiry_s=props.message_expiry_s,
            ack_handle=ack_handle,
            dup=self.dup,
        )


def decode_publish(header: int, packet: bytes | bytearray) -> Publish:
    """A PUBLISH body (MQTT v5) whose fixed header began with ``header``."""
    body = memoryview(packet)
    qos = (header & 0x06) >> 1
    if qos == 3:
        raise ValueError("QoS 3 does not exist")
    if len(body) < 2:
        raise ValueError("the packet ends before its topic's length")
    pos = 2 + ((body[0] << 8) | body[1])
    if pos > len(body):
        raise ValueError("the topic runs past the end of the packet")
    try:
        topic = str(body[2:pos], "utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the topic is not valid UTF-8: {exc.reason}") from exc
    mid = 0
    if qos:
        if pos + 2 > len(body):
            raise ValueError("the packet ends before its packet identifier")
        mid = (body[pos] << 8) | body[pos + 1]
        pos += 2
    props, pos = decode_publish_properties(body, pos)
    return Publish(
        topic=topic,
        qos=qos,
        mid=mid,
        retain=bool(header & 0x01),
        dup=bool(header & 0x08),
        properties=props,
        payload=bytes(body[pos:]),
    )
