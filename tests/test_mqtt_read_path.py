"""Real tier: the transport's own read path (large reads, packets cut by
sluicegate.mqtt.framing, the rest handed to paho) against a real Mosquitto, and against a
peer that does not speak MQTT properly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict

import pytest

from sluicegate.app.servers import ServerProcess
from sluicegate.config import MqttSettings
from sluicegate.mqtt import Message, MqttTransport

pytestmark = pytest.mark.integration

SIZES = (0, 1, 700, 65_535, 65_536, 200_000, 1_500_000)  # across the reads' size


async def test_a_burst_of_every_size_and_qos_arrives_whole_and_in_order(
    mosquitto: ServerProcess, unique: str
) -> None:
    """QoS 0 and 1 are cut out here, QoS 2 goes through paho: each stream arrives whole,
    in its order, also when the packets straddle reads."""
    settings = MqttSettings(port=mosquitto.port)
    got: dict[int, list[bytes]] = defaultdict(list)
    sent: dict[int, list[bytes]] = defaultdict(list)
    done = asyncio.Event()
    total = 3 * 40

    def take(msg: Message) -> None:
        got[msg.qos].append(msg.payload)
        if sum(map(len, got.values())) == total:
            done.set()

    async with (
        MqttTransport(settings, client_id=f"rd-{unique}") as reader,
        MqttTransport(settings, client_id=f"wr-{unique}") as writer,
    ):
        for qos in (0, 1, 2):
            await reader.subscribe(f"rp/{unique}/{qos}", take, qos=qos)
        for i in range(40):
            for qos in (0, 1, 2):
                size = SIZES[(i + qos) % len(SIZES)]
                payload = (b"%d:%d:" % (qos, i) + bytes(range(256)) * (size // 256 + 1))[:size]
                payload = payload or b"%d:%d" % (qos, i)
                sent[qos].append(payload)
                writer.publish_nowait(Message(f"rp/{unique}/{qos}", payload, qos=qos))
        await asyncio.wait_for(done.wait(), 30)
    assert {q: got[q] for q in (0, 1, 2)} == {q: sent[q] for q in (0, 1, 2)}


class _Peer:
    """A TCP peer that answers CONNECT with a CONNACK, then sends what the test gives it
    (once, on the first connection); it counts the connections."""

    def __init__(self, after_connack: bytes) -> None:
        self.after = after_connack
        self.connections = 0
        self.again = asyncio.Event()  # a second connection came

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readexactly(2)  # CONNECT: the fixed header's first bytes suffice
            writer.write(b"\x20\x03\x00\x00\x00")  # CONNACK v5: accepted, no properties
            if self.connections == 1:
                writer.write(self.after)
            else:
                self.again.set()
            await writer.drain()
            await reader.read()  # until the transport closes its side
        writer.close()


@pytest.mark.parametrize(
    ("garbage", "named"),
    [
        (b"\x30\xff\xff\xff\xff\x01", "four bytes"),  # no packet has a 5-byte length
        (b"\x30\x06\x00\x02\xff\xfe\x00x", "not valid UTF-8"),  # a PUBLISH's topic
    ],
)
async def test_a_peer_sending_what_is_not_mqtt_is_dropped_and_reconnected(
    garbage: bytes, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    peer = _Peer(garbage)
    server = await asyncio.start_server(peer.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = MqttSettings(port=port, reconnect_min_s=1, reconnect_max_s=1)
    lost = asyncio.Event()
    caplog.set_level(logging.WARNING, logger="sluicegate.mqtt")
    try:
        transport = MqttTransport(settings, client_id="victim")
        transport.on_disconnect(lost.set)
        await transport.connect()
        await asyncio.wait_for(lost.wait(), 10)
        await asyncio.wait_for(peer.again.wait(), 10)
        await transport.close()
    finally:
        server.close()
        await server.wait_closed()
    assert peer.connections >= 2
    assert named in caplog.text
