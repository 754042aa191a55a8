"""paho's packets on the way in and out: a PUBLISH's properties handed to paho already
packed, the PUBLISH packets paho receives decoded in one pass (installed as paho's
``decode_publish`` for every paho client of the process), and a message paho received
turned into our own :class:`~sluicegate.mqtt.framing.Publish`. The byte layouts live in
:mod:`sluicegate.mqtt.wire` and :mod:`sluicegate.mqtt.framing`; this module only fits them
to paho's types. No I/O.
"""

from __future__ import annotations

from functools import partial

import paho.mqtt.client as paho
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from sluicegate.mqtt import framing
from sluicegate.mqtt.framing import Publish
from sluicegate.mqtt.wire import PublishProperties, pack_publish_properties
from sluicegate.transport import UserProperties


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
    """paho's ``decode_publish`` for MQTT v5, in one pass
    (:func:`sluicegate.mqtt.framing.decode_publish`: the payload is copied once; paho
    copies the rest of the packet for each field and property)."""
    if protocol != MQTTProtocolVersion.MQTTv5:
        return paho_decode_publish(header, packet, protocol)
    try:
        pub = framing.decode_publish(header, packet)
    except ValueError as exc:
        raise MalformedPacket(f"malformed PUBLISH: {exc}") from exc
    return _packet.PublishPacket(
        dup=pub.dup,
        qos=pub.qos,
        retain=pub.retain,
        topic=pub.topic.encode(),
        mid=pub.mid,
        properties=_ReceivedProperties(pub.properties),
        payload=pub.payload,
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


def from_paho(msg: paho.MQTTMessage) -> Publish:
    """A message paho received (and decoded with :func:`decode_publish`), as ours."""
    props = msg.properties
    if isinstance(props, _ReceivedProperties):
        decoded: PublishProperties = object.__getattribute__(props, "decoded")
    else:  # paho's own decoder (not the paho ours was measured against)
        correlation = getattr(props, "CorrelationData", None)
        decoded = PublishProperties(
            message_expiry_s=getattr(props, "MessageExpiryInterval", None),
            content_type=getattr(props, "ContentType", None),
            response_topic=getattr(props, "ResponseTopic", None),
            correlation_data=bytes(correlation) if correlation is not None else None,
            user_properties=tuple((str(k), str(v)) for k, v in getattr(props, "UserProperty", ())),
        )
    return Publish(
        topic=msg.topic,
        qos=msg.qos,
        mid=msg.mid,
        retain=bool(msg.retain),
        dup=bool(msg.dup),
        properties=decoded,
        payload=bytes(msg.payload),
    )
