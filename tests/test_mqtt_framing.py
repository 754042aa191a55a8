"""Unit tier: MQTT packets cut out of a byte stream, and received PUBLISH bodies decoded
(sluicegate.mqtt.framing), against packets built from the specification's layout."""

from __future__ import annotations

import random

import pytest
from paho.mqtt.enums import MQTTProtocolVersion

from sluicegate.mqtt.framing import Frames, FramingError, decode_publish
from sluicegate.mqtt.packets import paho_decode_publish
from sluicegate.mqtt.wire import pack_publish_properties, varint


def _packet(header: int, body: bytes) -> bytes:
    return bytes([header]) + varint(len(body)) + body


def _publish_body(topic: str, payload: bytes, *, mid: int | None = None, props: bytes = b"\x00"):
    raw = topic.encode()
    ident = b"" if mid is None else mid.to_bytes(2, "big")
    return len(raw).to_bytes(2, "big") + raw + ident + props + payload


PACKETS = [
    (0x20, b"\x00\x00\x00"),  # CONNACK
    (0x30, _publish_body("a/b", b"x" * 700)),
    (0x32, _publish_body("a/c", b"", mid=7)),
    (0xD0, b""),  # PINGRESP: an empty body
    (0x30, _publish_body("big", bytes(range(256)) * 9000)),  # a three-byte length
    (0x90, b"\x00\x01\x00\x00"),  # SUBACK
]


def _cut(frames: Frames) -> list[tuple[int, bytes]]:
    out = []
    while (packet := frames.next()) is not None:
        out.append(packet)
    return out


def test_packets_come_out_whole_whatever_the_reads_deliver() -> None:
    stream = b"".join(_packet(h, b) for h, b in PACKETS)
    rng = random.Random(19)
    for _ in range(20):
        frames, got, at = Frames(), [], 0
        while at < len(stream):
            step = rng.choice((1, 2, 3, 64, 1500, 65_536, 300_000))
            frames.feed(stream[at : at + step])
            at += step
            got += _cut(frames)
        assert got == PACKETS


def test_a_packet_cut_short_says_how_much_it_lacks() -> None:
    whole = _packet(0x30, _publish_body("t", b"p" * 5000))
    frames = Frames()
    frames.feed(whole[:1000])
    assert frames.next() is None
    assert frames.wanted == len(whole) - 1000
    frames.feed(whole[1000:])
    assert frames.next() is not None
    assert frames.wanted == 0


def test_a_length_of_five_bytes_is_not_mqtt() -> None:
    frames = Frames()
    frames.feed(b"\x30\xff\xff\xff\xff\x01")
    with pytest.raises(FramingError, match="four bytes"):
        frames.next()


def test_cleared_frames_forget_a_partial_packet() -> None:
    frames = Frames()
    frames.feed(_packet(0x30, _publish_body("t", b"p" * 100))[:50])
    frames.clear()
    frames.feed(_packet(0xD0, b""))
    assert _cut(frames) == [(0xD0, b"")]


def test_a_publish_is_decoded_as_paho_decodes_it() -> None:
    props = pack_publish_properties("reply/here", b"\x01\x02", "image/png", (("k", "v"),), 30)
    assert props is not None
    body = _publish_body("sluicegate/v1/edge/e1/telemetry", b"\x00data", mid=513, props=props)
    ours = decode_publish(0x3B, body)  # QoS 1, dup, retain
    theirs = paho_decode_publish(0x3B, bytearray(body), MQTTProtocolVersion.MQTTv5)
    assert (ours.topic.encode(), ours.mid, ours.qos, ours.dup, ours.retain) == (
        theirs.topic,
        theirs.mid,
        theirs.qos,
        theirs.dup,
        theirs.retain,
    )
    assert ours.payload == theirs.payload == b"\x00data"
    msg = ours.message("handle")
    assert (msg.response_topic, msg.correlation_data, msg.content_type) == (
        "reply/here",
        b"\x01\x02",
        "image/png",
    )
    assert (msg.user_properties, msg.message_expiry_s, msg.ack_handle) == (
        (("k", "v"),),
        30,
        "handle",
    )


@pytest.mark.parametrize(
    ("header", "body", "named"),
    [
        (0x36, _publish_body("t", b""), "QoS 3"),
        (0x30, b"\x00", "topic's length"),
        (0x30, b"\x00\x09abc", "topic runs past"),
        (0x30, b"\x00\x02\xff\xfe\x00", "not valid UTF-8"),
        (0x32, b"\x00\x01t\x00", "packet identifier"),
        (0x30, b"\x00\x01t\x05\x02", "properties"),
    ],
)
def test_a_malformed_publish_is_named(header: int, body: bytes, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        decode_publish(header, body)
