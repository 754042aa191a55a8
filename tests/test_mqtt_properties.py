"""PUBLISH properties packed by the transport are what paho itself would pack."""

from __future__ import annotations

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from sluicegate.mqtt import _properties

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
    ours = _properties(topic, corr, ctype, user, expiry)
    assert ours is not None
    packed = ours.pack()  # type: ignore[no-untyped-call]
    assert packed == _paho(topic, corr, ctype, user, expiry)
    back = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    back.unpack(packed)  # type: ignore[no-untyped-call]
    assert getattr(back, "ResponseTopic", None) == topic
    assert getattr(back, "CorrelationData", None) == corr
    assert getattr(back, "UserProperty", []) == list(user)


def test_no_properties_at_all_is_none() -> None:
    assert _properties(None, None, None, ()) is None


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
        _properties(**args)  # type: ignore[arg-type]
