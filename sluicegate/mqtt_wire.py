"""MQTT v5 PUBLISH properties encoded as the specification lays them out (section 2.2.2).

The transport hands these bytes to paho as they are (paho's own encoder rebuilds its name
tables for every message). Only what Sluicegate sends is here: message expiry, content
type, response topic, correlation data and user properties, in paho's order, so the bytes
are the ones paho would write. A value MQTT cannot carry is refused by name. No paho here.
"""

from __future__ import annotations

from sluicegate.transport import UserProperties

_MAX_2_BYTES = 0xFFFF


def _utf8(name: str, value: str) -> bytes:
    data = value.encode("utf-8")
    if len(data) > _MAX_2_BYTES:
        raise ValueError(f"{name} is {len(data)} bytes in UTF-8; MQTT allows at most 65535")
    return len(data).to_bytes(2, "big") + data


def varint(n: int) -> bytes:
    """MQTT's Variable Byte Integer."""
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def pack_publish_properties(
    response_topic: str | None,
    correlation_data: bytes | None,
    content_type: str | None,
    user_properties: UserProperties,
    message_expiry_s: int | None = None,
) -> bytes | None:
    """The properties block (length first) of a PUBLISH; None when there is none to send."""
    if not (response_topic or content_type or user_properties) and (
        correlation_data is None and message_expiry_s is None
    ):
        return None
    body = bytearray()
    if message_expiry_s is not None:
        if not 0 <= message_expiry_s <= 0xFFFFFFFF:
            raise ValueError(f"message expiry {message_expiry_s} s is outside 0..4294967295")
        body += b"\x02" + message_expiry_s.to_bytes(4, "big")
    if content_type:
        body += b"\x03" + _utf8("content type", content_type)
    if response_topic:
        body += b"\x08" + _utf8("response topic", response_topic)
    if correlation_data is not None:
        if len(correlation_data) > _MAX_2_BYTES:
            raise ValueError(
                f"correlation data is {len(correlation_data)} bytes; MQTT allows at most 65535"
            )
        body += b"\x09" + len(correlation_data).to_bytes(2, "big") + correlation_data
    for key, value in user_properties:
        body += b"\x26" + _utf8("user property name", key) + _utf8(f"user property {key!r}", value)
    return varint(len(body)) + bytes(body)
