"""MQTT v5 PUBLISH properties encoded and decoded as the specification lays them out
(sections 2.2.2 and 3.3.2.3).

The transport hands the encoded bytes to paho as they are (paho's own encoder rebuilds its
name tables for every message). Only what Sluicegate sends is encoded: message expiry,
content type, response topic, correlation data and user properties, in paho's order, so
the bytes are the ones paho would write. A value MQTT cannot carry is refused by name.
Decoding reads every property a PUBLISH may carry, in one pass over a memoryview (paho's
decoder slices the rest of the packet once per property and scans its name table twice:
about 150 µs for a 100 KB work message); what is malformed is named. No paho here.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# -- decoding what arrives -------------------------------------------------------------------

_FORBIDDEN_CHARS = ("\x00", "\ufeff")  # [MQTT-1.5.4-2], [MQTT-1.5.4-3]


@dataclass(frozen=True, slots=True)
class PublishProperties:
    """The properties of a received PUBLISH, as the specification defines them."""

    payload_format: int | None = None
    message_expiry_s: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_ids: tuple[int, ...] = ()
    topic_alias: int | None = None
    user_properties: tuple[tuple[str, str], ...] = ()


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """A Variable Byte Integer at ``pos``: (value, position after it)."""
    value = 0
    for shift in (0, 7, 14, 21):
        if pos >= len(buf):
            raise ValueError("a variable byte integer runs past the end of the packet")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise ValueError("a variable byte integer is longer than 4 bytes")


def _read_binary(buf: memoryview, pos: int, end: int, what: str) -> tuple[bytes, int]:
    if pos + 2 > end:
        raise ValueError(f"{what}: its length runs past the properties")
    size = (buf[pos] << 8) | buf[pos + 1]
    stop = pos + 2 + size
    if stop > end:
        raise ValueError(f"{what}: {size} bytes run past the properties")
    return bytes(buf[pos + 2 : stop]), stop


def _read_text(buf: memoryview, pos: int, end: int, what: str) -> tuple[str, int]:
    raw, pos = _read_binary(buf, pos, end, what)
    try:
        text = raw.decode("utf-8")  # strict: no lone surrogates either [MQTT-1.5.4-1]
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8: {exc.reason}") from exc
    for char in _FORBIDDEN_CHARS:
        if char in text:
            raise ValueError(f"{what} contains U+{ord(char):04X}, which MQTT forbids")
    return text, pos


def _uint(buf: memoryview, pos: int, end: int, size: int, what: str) -> tuple[int, int]:
    if pos + size > end:
        raise ValueError(f"{what} runs past the properties")
    return int.from_bytes(buf[pos : pos + size], "big"), pos + size


def decode_publish_properties(buf: memoryview, pos: int) -> tuple[PublishProperties, int]:
    """The properties block of a PUBLISH at ``pos`` (its length first): the properties and
    the position of the payload. Raises ``ValueError`` naming what is malformed."""
    length, pos = read_varint(buf, pos)
    end = pos + length
    if end > len(buf):
        raise ValueError(f"the properties ({length} bytes) run past the end of the packet")
    fields: dict[str, object] = {}
    subscription_ids: list[int] = []
    user: list[tuple[str, str]] = []
    while pos < end:
        ident, pos = read_varint(buf, pos)
        if ident == 0x26:
            key, pos = _read_text(buf, pos, end, "a user property name")
            value, pos = _read_text(buf, pos, end, f"user property {key!r}")
            user.append((key, value))
            continue
        if ident == 0x0B:
            sub_id, pos = read_varint(buf, pos)
            if pos > end:
                raise ValueError("a subscription identifier runs past the properties")
            subscription_ids.append(sub_id)
            continue
        value_read: object
        if ident == 0x01:
            name = "payload_format"
            value_read, pos = _uint(buf, pos, end, 1, "the payload format indicator")
        elif ident == 0x02:
            name = "message_expiry_s"
            value_read, pos = _uint(buf, pos, end, 4, "the message expiry interval")
        elif ident == 0x03:
            name = "content_type"
            value_read, pos = _read_text(buf, pos, end, "the content type")
        elif ident == 0x08:
            name = "response_topic"
            value_read, pos = _read_text(buf, pos, end, "the response topic")
        elif ident == 0x09:
            name = "correlation_data"
            value_read, pos = _read_binary(buf, pos, end, "the correlation data")
        elif ident == 0x23:
            name = "topic_alias"
            value_read, pos = _uint(buf, pos, end, 2, "the topic alias")
        else:
            raise ValueError(f"property 0x{ident:02X} is not one a PUBLISH may carry")
        if name in fields:
            raise ValueError(f"property 0x{ident:02X} appears more than once")
        fields[name] = value_read
    if pos != end:
        raise ValueError("the last property runs past the properties' length")
    props = PublishProperties(
        subscription_ids=tuple(subscription_ids),
        user_properties=tuple(user),
        **fields,  # type: ignore[arg-type]
    )
    return props, end
