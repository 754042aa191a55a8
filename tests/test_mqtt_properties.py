"""PUBLISH properties packed by the transport are what paho itself would pack, and a
received PUBLISH is decoded into what paho's own decoder would make of it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from sluicegate.mqtt.packets import decode_publish, paho_decode_publish, publish_properties

CASES = [
    ("app/results", b"corr-1", "application/json", (("model", "defect-v1"),), None),
    (None, b"", None, (), None),  # empty correlation data is still sent
    ("r", None, "image/jpeg", (("k", "v"), ("k", "second"), ("ünï", "çødé")), 60),
    (None, bytes(range(256)) * 4, None, (("x", "y" * 1000),), 0),
    ("sluicegate/v1/edge/line-1-pc/returns", b"\x00\xff", "image/png", (), 4294967295),
]


def _paho(
    response_topic: str | None,
    correlation: bytes | None,
    content_type: str | None,
    user: tuple[tuple[str, str], ...],
    expiry: int | None,
) -> bytes:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if response_topic:
        props.ResponseTopic = response_topic
    if correlation is not None:
        props.CorrelationData = correlation
    if content_type:
        props.ContentType = content_type
    if user:
        props.UserProperty = list(user)
    if expiry is not None:
        props.MessageExpiryInterval = expiry
    packed: bytes = props.pack()  # type: ignore[no-untyped-call]
    return packed


@pytest.mark.parametrize(("topic", "corr", "ctype", "user", "expiry"), CASES)
def test_packed_like_paho_and_read_back_by_paho(
    topic: str | None,
    corr: bytes | None,
    ctype: str | None,
    user: tuple[tuple[str, str], ...],
    expiry: int | None,
) -> None:
    ours = publish_properties(topic, corr, ctype, user, expiry)
    assert ours is not None
    packed = ours.pack()  # type: ignore[no-untyped-call]
    assert packed == _paho(topic, corr, ctype, user, expiry)
    back = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    back.unpack(packed)  # type: ignore[no-untyped-call]
    assert getattr(back, "ResponseTopic", None) == topic
    assert getattr(back, "CorrelationData", None) == corr
    assert getattr(back, "UserProperty", []) == list(user)


def test_no_properties_at_all_is_none() -> None:
    assert publish_properties(None, None, None, ()) is None


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"response_topic": "t" * 70_000}, "response topic is 70000 bytes"),
        ({"correlation_data": bytes(70_000)}, "correlation data is 70000 bytes"),
        ({"user_properties": (("k", "v" * 70_000),)}, "user property 'k' is 70000 bytes"),
        ({"message_expiry_s": -1}, "message expiry -1 s is outside"),
    ],
)
def test_values_mqtt_cannot_carry_are_refused_by_name(
    kwargs: dict[str, object], words: str
) -> None:
    args: dict[str, object] = {
        "response_topic": None,
        "correlation_data": None,
        "content_type": None,
        "user_properties": (),
        **kwargs,
    }
    with pytest.raises(ValueError, match=words):
        publish_properties(**args)  # type: ignore[arg-type]


# -- what arrives: decoded in one pass, as paho's own decoder would --------------------------

_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\ufeff"), max_size=40
)


def _publish_packet(topic: str, mid: int | None, props: Properties | None, payload: bytes) -> bytes:
    """A PUBLISH's variable header and payload (what paho decodes), properties packed by
    paho itself."""
    raw_topic = topic.encode()
    head = len(raw_topic).to_bytes(2, "big") + raw_topic
    if mid is not None:
        head += mid.to_bytes(2, "big")
    packed = props.pack() if props is not None else b"\x00"  # type: ignore[no-untyped-call]
    return head + packed + payload


@st.composite
def _paho_properties(draw: st.DrawFn) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if draw(st.booleans()):
        props.PayloadFormatIndicator = draw(st.integers(0, 1))
    if draw(st.booleans()):
        props.MessageExpiryInterval = draw(st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        props.ContentType = draw(_TEXT)
    if draw(st.booleans()):
        props.ResponseTopic = draw(_TEXT.filter(bool))
    if draw(st.booleans()):
        props.CorrelationData = draw(st.binary(max_size=64))
    if draw(st.booleans()):
        props.TopicAlias = draw(st.integers(1, 0xFFFF))
    subs = draw(st.lists(st.integers(1, 2**28 - 1), max_size=3))
    if subs:
        props.SubscriptionIdentifier = subs
    user = draw(st.lists(st.tuples(_TEXT, _TEXT), max_size=6))
    if user:
        props.UserProperty = user
    return props


@settings(max_examples=300, deadline=None)
@given(
    topic=_TEXT,
    qos=st.integers(0, 2),
    mid=st.integers(1, 0xFFFF),
    props=st.one_of(st.none(), _paho_properties()),
    payload=st.binary(max_size=300),
    flags=st.integers(0, 0x09),
)
def test_a_received_publish_is_decoded_as_paho_decodes_it(
    topic: str, qos: int, mid: int, props: Properties | None, payload: bytes, flags: int
) -> None:
    header = 0x30 | (qos << 1) | (flags & 0x09)
    packet = bytearray(_publish_packet(topic, mid if qos else None, props, payload))
    ours = decode_publish(header, packet, MQTTProtocolVersion.MQTTv5)
    theirs = paho_decode_publish(header, bytearray(packet), MQTTProtocolVersion.MQTTv5)
    assert (ours.topic, ours.mid, ours.qos, ours.dup, ours.retain, ours.payload) == (
        theirs.topic,
        theirs.mid,
        theirs.qos,
        theirs.dup,
        theirs.retain,
        theirs.payload,
    )
    assert ours.properties is not None
    assert theirs.properties is not None
    assert ours.properties.json() == theirs.properties.json()  # type: ignore[no-untyped-call]
    assert str(ours.properties) == str(theirs.properties)


def test_paho_clients_of_this_process_decode_with_ours() -> None:
    from paho.mqtt import _packet

    assert _packet.decode_publish is decode_publish


def test_every_truncation_of_the_header_is_malformed() -> None:
    # (paho's own decoder takes the last two cuts: it reads the last value cut short.)
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ResponseTopic = "app/results"
    props.CorrelationData = b"job-1"
    props.UserProperty = [("model", "defect-v1"), ("job-id", "j1")]
    whole = _publish_packet("sluicegate/v1/edge/e1/jobs", 7, props, b"")
    for cut in range(len(whole)):
        with pytest.raises(MalformedPacket):
            decode_publish(0x32, bytearray(whole[:cut]), MQTTProtocolVersion.MQTTv5)


def _with_properties(block: bytes) -> bytes:
    return b"\x00\x01t" + bytes([len(block)]) + block + b"payload"


@pytest.mark.parametrize(
    ("block", "named"),
    [
        (b"\x26\x00\x01k\x00\x02\xc3\x28", "user property 'k' is not valid UTF-8"),
        (b"\x03\x00\x02a\x00", "the content type contains U+0000"),
        (b"\x08\x00\x04\xef\xbb\xbfr", "the response topic contains U+FEFF"),
        (b"\x11\x00\x00\x00\x01", "property 0x11 is not one a PUBLISH may carry"),
        (b"\x03\x00\x01a\x03\x00\x01b", "property 0x03 appears more than once"),
        (b"\x0b\xff\xff\xff\xff\x01", "longer than 4 bytes"),
        (b"\x09\x00\x09abc", "the correlation data: 9 bytes run past the properties"),
    ],
)
def test_a_malformed_property_is_refused_by_name(block: bytes, named: str) -> None:
    with pytest.raises(MalformedPacket, match=re.escape(named)):
        decode_publish(0x30, bytearray(_with_properties(block)), MQTTProtocolVersion.MQTTv5)
    with pytest.raises(MalformedPacket):  # paho agrees that each is malformed
        paho_decode_publish(0x30, bytearray(_with_properties(block)), MQTTProtocolVersion.MQTTv5)
