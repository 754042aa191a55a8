"""A v5 message across a 3.1.1 bridge (sluicegate.wire_peer.wrap/unwrap): its properties ride
in the payload and come back whole; anything else on a peer's work or returns topic is
refused by name."""

from __future__ import annotations

import pytest

from sluicegate.errors import WireError
from sluicegate.transport import Message
from sluicegate.wire_peer import ENVELOPE_MAGIC, unwrap, wrap

TOPIC = "sluicegate/v1/peer/north-site/south-site/work/gpu-1/pc-1"
ORIGINAL = Message(
    TOPIC,
    b"\xff\xd8 an image \x00",
    qos=1,
    response_topic="not/carried",
    correlation_data=b"\x00app\xff",
    content_type="image/jpeg",
    user_properties=(("job-id", "j-1"), ("attempt", "2"), ("job-id", "repeated")),
)


def test_a_wrapped_message_crosses_with_no_property_and_comes_back_whole() -> None:
    crossing = wrap(ORIGINAL)
    assert (crossing.topic, crossing.qos) == (TOPIC, 1)
    assert crossing.user_properties == ()
    assert crossing.correlation_data is None
    assert crossing.content_type is None
    back = unwrap(crossing)
    assert back.payload == ORIGINAL.payload
    assert back.user_properties == ORIGINAL.user_properties  # order and repeats kept
    assert back.correlation_data == ORIGINAL.correlation_data
    assert back.content_type == "image/jpeg"
    assert back.response_topic is None  # where a result goes is the receiver's to derive


def test_a_message_without_correlation_or_content_type_stays_without() -> None:
    back = unwrap(wrap(Message(TOPIC, b"x", qos=1)))
    assert (back.correlation_data, back.content_type, back.user_properties) == (None, None, ())


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"\xff\xd8 a bare image", "not a peer envelope"),
        (ENVELOPE_MAGIC + b"\x00\x00", "not a peer envelope"),
        (ENVELOPE_MAGIC + (1 << 20).to_bytes(4, "big") + b"{}", "at most"),
        (ENVELOPE_MAGIC + (10).to_bytes(4, "big") + b"{}", "whole"),
        (ENVELOPE_MAGIC + (2).to_bytes(4, "big") + b"[]", "peer envelope"),
        (ENVELOPE_MAGIC + (17).to_bytes(4, "big") + b'{"correlation":1}', "correlation"),
        (ENVELOPE_MAGIC + (22).to_bytes(4, "big") + b'{"correlation":"a+b/"}', "correlation"),
    ],
)
def test_what_is_no_envelope_is_refused_by_name(payload: bytes, words: str) -> None:
    with pytest.raises(WireError, match=words):
        unwrap(Message(TOPIC, payload, qos=1))
