"""paho's private hooks the transport is built on, checked where they live: if a paho
release moves them, this file fails by name instead of the transport silently falling back
to paho's slow decoder or reading its own socket behind the reader's back.

The hooks: ``paho.mqtt._packet`` (``decode_publish``, replaced by ours for MQTT v5, and the
``PublishPacket`` it returns), ``Client._sock_recv`` (``FedClient`` overrides it to read
the packets the reader hands over) and ``Client._packet_read`` calling it. pyproject.toml
pins paho to the releases these were written against.
"""

from __future__ import annotations

import inspect
import tomllib
from importlib.metadata import version
from pathlib import Path

import paho.mqtt.client as paho
from packaging.requirements import Requirement
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTProtocolVersion

from sluicegate.mqtt import packets
from sluicegate.mqtt.client import FedClient
from sluicegate.mqtt.wire import pack_publish_properties

ROOT = Path(__file__).resolve().parents[1]


def _paho_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "paho-mqtt"]
    return req


def test_the_installed_paho_is_within_the_pinned_range() -> None:
    req = _paho_requirement()
    assert req.specifier.contains(version("paho-mqtt")), (req, version("paho-mqtt"))


def test_the_pin_has_a_ceiling_below_the_next_minor_release() -> None:
    # The hooks are private: a minor release may move them, so the range stops before it.
    req = _paho_requirement()
    assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), req
    assert not req.specifier.contains("2.3.0"), req


def test_our_publish_decoder_is_installed_over_pahos() -> None:
    assert _packet.decode_publish is packets.decode_publish
    assert packets.paho_decode_publish.__module__ == "paho.mqtt._packet"


def test_pahos_decoder_and_its_packet_have_the_shape_ours_replaces() -> None:
    params = list(inspect.signature(packets.paho_decode_publish).parameters)
    assert params == ["header", "packet", "protocol"]
    assert _packet.PublishPacket._fields == (
        "dup",
        "qos",
        "retain",
        "topic",
        "mid",
        "properties",
        "payload",
    )


def test_pahos_client_reads_through_the_method_fed_client_overrides() -> None:
    assert "_sock_recv" in vars(paho.Client)
    assert list(inspect.signature(paho.Client._sock_recv).parameters) == ["self", "bufsize"]
    assert "self._sock_recv(" in inspect.getsource(paho.Client._packet_read)
    assert "_sock_recv" in vars(FedClient)


def test_a_v5_publish_decodes_to_the_same_packet_as_pahos_own() -> None:
    props = pack_publish_properties("r/1", b"c", "image/jpeg", (("model", "m"),), None)
    assert props is not None
    topic = b"t/in"
    body = len(topic).to_bytes(2, "big") + topic + (7).to_bytes(2, "big") + props + b"JPEG"
    header = 0x30 | (1 << 1)  # PUBLISH, QoS 1
    ours = packets.decode_publish(header, body, MQTTProtocolVersion.MQTTv5)
    theirs = packets.paho_decode_publish(header, body, MQTTProtocolVersion.MQTTv5)
    assert (ours.dup, ours.qos, ours.retain, ours.topic, ours.mid, bytes(ours.payload)) == (
        theirs.dup,
        theirs.qos,
        theirs.retain,
        theirs.topic,
        theirs.mid,
        bytes(theirs.payload),
    )
    assert theirs.properties is not None
    assert ours.properties is not None
    assert ours.properties.ResponseTopic == theirs.properties.ResponseTopic == "r/1"
    assert ours.properties.CorrelationData == theirs.properties.CorrelationData == b"c"
    assert ours.properties.UserProperty == theirs.properties.UserProperty == [("model", "m")]
