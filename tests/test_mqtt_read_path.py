"""Real tier: the transport's own read path (large reads, packets cut by
sluicegate.mqtt.framing, the rest handed to paho, the broker's read gap) against a real
Mosquitto, and against a peer that does not speak MQTT properly."""

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
GAP_S = 0.005  # a read gap, a little longer than the broker's default


@pytest.mark.parametrize("gap", [0.0, GAP_S])
async def test_a_burst_of_every_size_and_qos_arrives_whole_and_in_order(
    mosquitto: ServerProcess, unique: str, gap: float
) -> None:
    """QoS 0 and 1 are cut out here, QoS 2 goes through paho: each stream arrives whole,
    in its order, also when the packets straddle reads, and with a read gap between
    reads that drained the socket."""
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
        MqttTransport(settings, client_id=f"rd-{unique}", read_gap_s=gap) as reader,
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


async def test_with_a_read_gap_every_request_after_a_quiet_spell_is_answered(
    mosquitto: ServerProcess, unique: str
) -> None:
    """One request at a time, each sent once the last answer came: every read drains the
    socket and starts a gap, and the next request, arriving in it or after it, is still
    read and answered (the answer written at once, the gap being on reading only)."""
    settings = MqttSettings(port=mosquitto.port)
    answers: asyncio.Queue[bytes] = asyncio.Queue()
    async with (
        MqttTransport(settings, client_id=f"srv-{unique}", read_gap_s=GAP_S) as server,
        MqttTransport(settings, client_id=f"cli-{unique}") as client,
    ):

        def answer(msg: Message) -> None:
            server.publish_nowait(Message(f"gap/{unique}/ans", b"re:" + msg.payload))

        await server.subscribe(f"gap/{unique}/req", answer)
        await client.subscribe(f"gap/{unique}/ans", lambda m: answers.put_nowait(m.payload))
        got = []
        for i in range(30):
            client.publish_nowait(Message(f"gap/{unique}/req", b"%d" % i))
            got.append(await asyncio.wait_for(answers.get(), 10))
    assert got == [b"re:%d" % i for i in range(30)]


async def test_with_a_read_gap_the_transport_reconnects_and_reads_again(
    own_mosquitto: ServerProcess, unique: str
) -> None:
    """The broker killed while a read gap may be pending: the new connection's socket is
    watched and read, not left to the old connection's gap."""
    settings = MqttSettings(port=own_mosquitto.port, reconnect_min_s=1, reconnect_max_s=2)
    got: asyncio.Queue[bytes] = asyncio.Queue()
    lost, back = asyncio.Event(), asyncio.Event()
    async with MqttTransport(settings, client_id=f"g-{unique}", read_gap_s=GAP_S) as t:
        t.on_disconnect(lost.set)
        t.on_connect(back.set)
        await t.subscribe(f"g/{unique}", lambda m: got.put_nowait(m.payload))
        await t.publish(Message(f"g/{unique}", b"before", qos=1), wait=True)
        assert await asyncio.wait_for(got.get(), 10) == b"before"
        back.clear()
        await asyncio.to_thread(own_mosquitto.kill)
        await asyncio.wait_for(lost.wait(), 10)
        await asyncio.to_thread(own_mosquitto.restart)
        await asyncio.wait_for(back.wait(), 15)
        for i in range(3):
            await t.publish(Message(f"g/{unique}", b"after %d" % i, qos=1), wait=True)
        after = [await asyncio.wait_for(got.get(), 10) for _ in range(3)]
    assert after == [b"after 0", b"after 1", b"after 2"]


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
