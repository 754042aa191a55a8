"""paho's packets on the way in and out: a PUBLISH's properties handed to paho already
packed, received PUBLISH packets decoded in one pass (installed as paho's
``decode_publish`` for every paho client of the process), and a received paho message
turned into our own :class:`~sluicegate.transport.Message`. The byte layouts live in
:mod:`sluicegate.mqtt.wire`; this module only fits them to paho's types. No I/O.
"""

from __future__ import annotations

from functools import partial

import paho.mqtt.client as paho
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from sluicegate.mqtt.wire import (
    PublishProperties,
    decode_publish_properties,
    pack_publish_properties,
)
from sluicegate.transport import Message, UserProperties


def new_properties(packet_type: int) -> Properties:
    return Properties(packet_type)  # type: ignore[no-untyped-call]


class _PublishProperties(Properties):
    """PUBLISH properties already packed (:mod:`sluicegate.mqtt_wire`).

    paho's :class:`Properties` rebuilds its name tables for every instance and scans all
    27 property names on every ``pack()``: about 60 µs a message on the broker's hot path.
    paho only ever calls ``pack()`` on a PUBLISH's
    properties, so this subclass keeps the packed bytes and skips the generic machinery.
    """

    def __init__(self, packed: bytes) -> None:  # no super().__init__: that is the cost
        object.__setattr__(self, "packetType", PacketTypes.PUBLISH)
        object.__setattr__(self, "_packed", packed)

    def pack(self) -> bytes:
        packed: bytes = object.__getattribute__(self, "_packed")
        return packed


class _ReceivedProperties(Properties):
    """A received PUBLISH's properties, decoded by :mod:`sluicegate.mqtt_wire`, with the
    attributes paho's own decoder would have set (for anyone reading them paho's way)."""

    def __init__(self, decoded: PublishProperties) -> None:  # no super().__init__: cost
        put = partial(object.__setattr__, self)
        put("packetType", PacketTypes.PUBLISH)
        put("decoded", decoded)
        put("names", _PAHO_NAMES)  # what paho's __str__ and json() walk
        for attr, value in (
            ("PayloadFormatIndicator", decoded.payload_format),
            ("MessageExpiryInterval", decoded.message_expiry_s),
            ("ContentType", decoded.content_type),
            ("ResponseTopic", decoded.response_topic),
            ("CorrelationData", decoded.correlation_data),
            ("TopicAlias", decoded.topic_alias),
        ):
            if value is not None:
                put(attr, value)
        if decoded.subscription_ids:
            put("SubscriptionIdentifier", list(decoded.subscription_ids))
        if decoded.user_properties:
            put("UserProperty", list(decoded.user_properties))


_PAHO_NAMES = dict(Properties(PacketTypes.PUBLISH).names)  # type: ignore[no-untyped-call]
paho_decode_publish = _packet.decode_publish


def decode_publish(
    header: int, packet: bytes | bytearray, protocol: MQTTProtocolVersion
) -> _packet.PublishPacket:
    """paho's ``decode_publish`` for MQTT v5, in one pass: the payload is copied once (paho
    copies the rest of the packet for each field and property) and the properties are
    read by :func:`~sluicegate.mqtt_wire.decode_publish_properties`."""
    if protocol != MQTTProtocolVersion.MQTTv5:
        return paho_decode_publish(header, packet, protocol)
    view = memoryview(packet)
    qos = (header & 0x06) >> 1
    try:
        if len(view) < 2:
            raise ValueError("the packet ends before its topic's length")
        pos = 2 + ((view[0] << 8) | view[1])
        if pos > len(view):
            raise ValueError("the topic runs past the end of the packet")
        topic = bytes(view[2:pos])
        mid = 0
        if qos > 0:
            if pos + 2 > len(view):
                raise ValueError("the packet ends before its packet identifier")
            mid = (view[pos] << 8) | view[pos + 1]
            pos += 2
        decoded, pos = decode_publish_properties(view, pos)
    except ValueError as exc:
        raise MalformedPacket(f"malformed PUBLISH: {exc}") from exc
    return _packet.PublishPacket(
        dup=bool(header & 0x08),
        qos=qos,
        retain=bool(header & 0x01),
        topic=topic,
        mid=mid,
        properties=_ReceivedProperties(decoded),
        payload=bytes(view[pos:]),
    )


def _install_decoder() -> None:
    """Have paho decode received PUBLISH packets with :func:`decode_publish` (paho calls
    ``_packet.decode_publish`` through its module at each packet). Only over the function
    it was measured and tested against; another paho keeps its own."""
    original = getattr(_packet, "decode_publish", None)
    if getattr(original, "__module__", None) == "paho.mqtt._packet":
        _packet.decode_publish = decode_publish


_install_decoder()


def publish_properties(
    response_topic: str | None,
    correlation_data: bytes | None,
    content_type: str | None,
    user_properties: UserProperties,
    message_expiry_s: int | None = None,
) -> Properties | None:
    packed = pack_publish_properties(
        response_topic, correlation_data, content_type, user_properties, message_expiry_s
    )
    return None if packed is None else _PublishProperties(packed)


def to_message(msg: paho.MQTTMessage, ack_handle: object = None) -> Message:
    """Convert a paho message into our own :class:`Message`."""
    props = msg.properties
    response_topic = correlation = content_type = expiry = None
    user: UserProperties = ()
    if isinstance(props, _ReceivedProperties):
        decoded: PublishProperties = object.__getattribute__(props, "decoded")
        response_topic = decoded.response_topic
        correlation = decoded.correlation_data
        content_type = decoded.content_type
        expiry = decoded.message_expiry_s
        user = decoded.user_properties
    elif props is not None:
        response_topic = getattr(props, "ResponseTopic", None)
        correlation = getattr(props, "CorrelationData", None)
        content_type = getattr(props, "ContentType", None)
        expiry = getattr(props, "MessageExpiryInterval", None)
        user = tuple((str(k), str(v)) for k, v in getattr(props, "UserProperty", ()))
    return Message(
        topic=msg.topic,
        payload=bytes(msg.payload),
        qos=msg.qos,
        retain=bool(msg.retain),
        response_topic=response_topic,
        correlation_data=bytes(correlation) if correlation is not None else None,
        content_type=content_type,
        user_properties=user,
        message_expiry_s=expiry,
        ack_handle=ack_handle,
        dup=bool(msg.dup),
    )
