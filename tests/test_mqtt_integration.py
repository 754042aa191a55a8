"""Real tier: the paho-to-asyncio bridge against a real Mosquitto."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest

from sluicegate.app.servers import ServerProcess, free_port
from sluicegate.config import MqttSettings
from sluicegate.errors import TransportError
from sluicegate.mqtt import Message, MqttTransport, Will
from tests.support import PlainClient

pytestmark = pytest.mark.integration


async def _next(queue: asyncio.Queue[Message], timeout: float = 10.0) -> Message:
    return await asyncio.wait_for(queue.get(), timeout)


async def test_properties_round_trip_and_acked_publish(
    mosquitto: ServerProcess, unique: str
) -> None:
    settings = MqttSettings(port=mosquitto.port)
    got: asyncio.Queue[Message] = asyncio.Queue()
    async with (
        MqttTransport(settings, client_id=f"a-{unique}") as a,
        MqttTransport(settings, client_id=f"b-{unique}") as b,
    ):
        await b.subscribe(f"t/{unique}/#", got.put_nowait)
        await a.publish(
            Message(
                f"t/{unique}/x",
                b"\x00payload",
                qos=1,
                response_topic="r/1",
                correlation_data=b"\x01\x02",
                content_type="image/png",
                user_properties=(("model", "m"), ("model", "second")),
            ),
            wait=True,
        )
        msg = await _next(got)
    assert msg.payload == b"\x00payload"
    assert (msg.response_topic, msg.correlation_data, msg.content_type) == (
        "r/1",
        b"\x01\x02",
        "image/png",
    )
    assert msg.user_property("model") == "m"
    assert msg.user_property("absent") is None
    assert msg.qos == 1


async def test_socket_has_no_nagle_delay(mosquitto: ServerProcess, unique: str) -> None:
    async with MqttTransport(MqttSettings(port=mosquitto.port), client_id=f"n-{unique}") as t:
        sock = t._client.socket()
        assert isinstance(sock, socket.socket)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


async def test_failing_handler_does_not_stop_delivery(
    mosquitto: ServerProcess, unique: str
) -> None:
    settings = MqttSettings(port=mosquitto.port)
    seen: asyncio.Queue[Message] = asyncio.Queue()

    def handler(msg: Message) -> None:
        seen.put_nowait(msg)
        if msg.payload == b"boom":
            raise RuntimeError("handler bug")

    async with MqttTransport(settings, client_id=f"h-{unique}") as t:
        await t.subscribe(f"h/{unique}", handler)
        for payload in (b"boom", b"after"):
            await t.publish(Message(f"h/{unique}", payload, qos=1), wait=True)
        assert (await _next(seen)).payload == b"boom"
        assert (await _next(seen)).payload == b"after"


async def test_reconnects_and_resubscribes_after_broker_restart(
    own_mosquitto: ServerProcess, unique: str
) -> None:
    settings = MqttSettings(port=own_mosquitto.port, reconnect_min_s=1, reconnect_max_s=2)
    got: asyncio.Queue[Message] = asyncio.Queue()
    lost = asyncio.Event()
    back = asyncio.Event()
    async with MqttTransport(settings, client_id=f"r-{unique}") as t:
        t.on_disconnect(lost.set)
        await t.subscribe(f"r/{unique}", got.put_nowait)
        await t.publish(Message(f"r/{unique}", b"before", qos=1), wait=True)
        assert (await _next(got)).payload == b"before"
        await asyncio.to_thread(own_mosquitto.kill)
        await asyncio.wait_for(lost.wait(), 10)
        assert not t.connected
        t.on_connect(back.set)
        await asyncio.to_thread(own_mosquitto.restart)
        await asyncio.wait_for(back.wait(), 15)
        await t.publish(Message(f"r/{unique}", b"after", qos=1), wait=True)
        assert (await _next(got)).payload == b"after"


async def test_last_will_is_published_when_the_client_vanishes(
    mosquitto: ServerProcess, unique: str
) -> None:
    settings = MqttSettings(port=mosquitto.port)
    got: asyncio.Queue[Message] = asyncio.Queue()
    async with MqttTransport(settings, client_id=f"w-{unique}") as watcher:
        await watcher.subscribe(f"will/{unique}", got.put_nowait)
        doomed = MqttTransport(
            settings, client_id=f"d-{unique}", will=Will(f"will/{unique}", b"gone", retain=False)
        )
        await doomed.connect()
        sock = doomed._client.socket()
        assert isinstance(sock, socket.socket)
        sock.shutdown(socket.SHUT_RDWR)  # the connection dies without a DISCONNECT
        assert (await _next(got)).payload == b"gone"
        await doomed.close()


async def test_connect_to_nothing_is_a_clear_error() -> None:
    settings = MqttSettings(port=free_port())
    t = MqttTransport(settings, client_id="nobody")
    with pytest.raises(TransportError, match=r"no MQTT broker answered at 127\.0\.0\.1:\d+"):
        await t.connect(timeout=1.0)


async def test_unacked_message_comes_back_after_the_connection_dies(
    mosquitto: ServerProcess, unique: str
) -> None:
    settings = MqttSettings(port=mosquitto.port, reconnect_min_s=1, reconnect_max_s=1)
    topic = f"ack/{unique}"
    got: asyncio.Queue[Message] = asyncio.Queue()
    async with MqttTransport(settings, client_id=f"p-{unique}") as publisher:
        durable = MqttTransport(
            settings, client_id=f"m-{unique}", clean_start=False, session_expiry_s=60
        )
        await durable.connect()
        await durable.subscribe(topic, got.put_nowait, qos=1, manual_ack=True)
        await publisher.publish(Message(topic, b"job", qos=1), wait=True)
        first = await _next(got)
        assert first.payload == b"job"
        assert first.ack_handle is not None
        assert first == Message(topic, b"job", qos=1)  # the handle is not part of the value
        back = asyncio.Event()
        durable.on_connect(back.set)
        sock = durable._client.socket()
        assert isinstance(sock, socket.socket)
        sock.shutdown(socket.SHUT_RDWR)  # dies without DISCONNECT, before the ack
        again = await _next(got, 15)
        assert again.payload == b"job"  # redelivered on the new connection ...
        assert again.dup  # ... marked as such
        assert not first.dup
        await asyncio.wait_for(back.wait(), 10)
        durable.ack(first)  # from the lost connection: dropped, never sent
        assert durable.stale_acks == 1
        durable.ack(again)
        # Sent, not dropped: had the connection been replaced again meanwhile, the broker
        # would owe "job" once more and the resumed session below would get it first.
        assert durable.stale_acks == 1
        # Mosquitto reads a connection's packets in order: once this publish is acked it
        # has read that PUBACK too (else a new connection of the same id could take the
        # session over before it does, and "job" would rightly come again).
        await durable.publish(Message(f"{topic}/probe", b"", qos=1), wait=True)
        await durable.close()
        # While the session is offline a second job is queued for it; the first was acked.
        await publisher.publish(Message(topic, b"second", qos=1), wait=True)
        later: asyncio.Queue[Message] = asyncio.Queue()
        resumed = MqttTransport(
            settings, client_id=f"m-{unique}", clean_start=False, session_expiry_s=60
        )
        await resumed.connect()
        await resumed.subscribe(topic, later.put_nowait, qos=1, manual_ack=True)
        await publisher.publish(Message(topic, b"marker", qos=1), wait=True)
        assert [(await _next(later)).payload for _ in range(2)] == [b"second", b"marker"]
        await resumed.close()


async def test_auto_acked_subscription_is_not_redelivered(
    mosquitto: ServerProcess, unique: str
) -> None:
    settings = MqttSettings(port=mosquitto.port)
    topic = f"auto/{unique}"
    got: asyncio.Queue[Message] = asyncio.Queue()
    async with MqttTransport(settings, client_id=f"p-{unique}") as publisher:
        for round_ in ("first", "second"):
            t = MqttTransport(
                settings, client_id=f"a-{unique}", clean_start=False, session_expiry_s=60
            )
            await t.connect()
            await t.subscribe(topic, got.put_nowait, qos=1)
            await publisher.publish(Message(topic, round_.encode(), qos=1), wait=True)
            assert (await _next(got)).payload == round_.encode()
            await t.close()
        assert got.empty()


_SUBSCRIBER = """
import asyncio, sys
from sluicegate.config import MqttSettings
from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Message

async def main():
    port, client_id, topic = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    t = MqttTransport(MqttSettings(port=port), client_id=client_id, clean_start=False,
                      session_expiry_s=60)
    await t.connect()
    got = asyncio.Event()
    await t.subscribe(topic, lambda m: got.set(), qos=1, manual_ack=True)
    print("subscribed", flush=True)
    await got.wait()
    print("got", flush=True)  # and never acks: SIGKILL comes next
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_message_a_killed_process_never_acked_goes_to_its_next_session(
    mosquitto: ServerProcess, unique: str
) -> None:
    topic = f"kill/{unique}"
    client_id = f"k-{unique}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _SUBSCRIBER,
        str(mosquitto.port),
        client_id,
        topic,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 20) == b"subscribed\n"
        settings = MqttSettings(port=mosquitto.port)
        async with MqttTransport(settings, client_id=f"p-{unique}") as publisher:
            await publisher.publish(Message(topic, b"job", qos=1), wait=True)
            assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"got\n"
            proc.kill()
            await proc.wait()
            got: asyncio.Queue[Message] = asyncio.Queue()
            resumed = MqttTransport(
                settings, client_id=client_id, clean_start=False, session_expiry_s=60
            )
            await resumed.connect()
            await resumed.subscribe(topic, got.put_nowait, qos=1, manual_ack=True)
            again = await _next(got)
            assert again.payload == b"job"
            assert again.dup  # the broker marks what it delivers a second time
            await resumed.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_backlog_of_a_session_waits_in_the_broker_not_here(
    mosquitto: ServerProcess, unique: str
) -> None:
    # 1,500 requests queue for an offline session. Its next connection gets at most
    # max_pending unacked at once (Receive Maximum), parked until the role subscribes; the
    # rest follow as it acks: none is dropped on the floor.
    settings = MqttSettings(port=mosquitto.port)
    topic = f"backlog/{unique}"
    persistent = {"clean_start": False, "session_expiry_s": 60, "max_pending": 100}
    durable = MqttTransport(settings, client_id=f"bl-{unique}", **persistent)  # type: ignore[arg-type]
    await durable.connect()
    await durable.subscribe(topic, lambda m: None, qos=1, manual_ack=True)
    await durable.close()
    async with MqttTransport(settings, client_id=f"pub-{unique}") as publisher:
        for i in range(1500):
            publisher.publish_nowait(Message(topic, str(i).encode(), qos=1))
        await publisher.publish(Message(topic, b"last", qos=1), wait=True)
    resumed = MqttTransport(settings, client_id=f"bl-{unique}", **persistent)  # type: ignore[arg-type]
    await resumed.connect()
    async with asyncio.timeout(10):
        # No event tells when paho's thread parked them: poll, bounded by the timeout.
        while len(resumed._parked) < 100:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    got: list[bytes] = []
    done = asyncio.Event()

    def take(msg: Message) -> None:
        got.append(msg.payload)
        resumed.ack(msg)
        if msg.payload == b"last":
            done.set()

    await resumed.subscribe(topic, take, qos=1, manual_ack=True)
    await asyncio.wait_for(done.wait(), 20)
    await resumed.close()
    assert len(resumed._parked) == 0
    assert sorted(set(got) - {b"last"}, key=int) == [str(i).encode() for i in range(1500)]


async def test_a_publish_off_paho_callbacks_is_on_the_wire_before_the_loop_turns(
    mosquitto: ServerProcess, unique: str
) -> None:
    """Written at once, not when the loop next polls: the loop is held here (a blocking
    wait on its own thread) and another client still gets the message."""
    listener = PlainClient(mosquitto.port)
    try:
        listener.subscribe(f"w/{unique}")
        async with MqttTransport(MqttSettings(port=mosquitto.port), client_id=f"w-{unique}") as t:
            for qos in (0, 1):
                t.publish_nowait(Message(f"w/{unique}", f"qos{qos}".encode(), qos=qos))
                got = listener.next(timeout=5)  # blocks the loop: nothing else runs meanwhile
                assert got.payload == f"qos{qos}".encode()
    finally:
        listener.close()


async def test_a_handlers_publish_is_on_the_wire_right_after_the_read(
    mosquitto: ServerProcess, unique: str
) -> None:
    """Not at the loop's next poll: right after the read that ran the handler. The handler
    also queues a callback that holds the loop (a blocking wait for another client to get
    the message); a publish left to the writer would only go out after it gave up."""
    listener = PlainClient(mosquitto.port)
    got: list[bytes] = []
    try:
        listener.subscribe(f"h/{unique}/out")
        settings = MqttSettings(port=mosquitto.port)
        async with (
            MqttTransport(settings, client_id=f"h-{unique}") as handler_side,
            MqttTransport(settings, client_id=f"s-{unique}") as sender,
        ):
            loop = asyncio.get_running_loop()
            held = asyncio.Event()

            def hold_the_loop() -> None:
                try:
                    got.append(listener.next(timeout=5).payload)
                finally:
                    held.set()

            def answer(msg: Message) -> None:
                handler_side.publish_nowait(Message(f"h/{unique}/out", msg.payload, qos=1))
                loop.call_soon(hold_the_loop)

            await handler_side.subscribe(f"h/{unique}/in", answer, qos=1)
            await sender.publish(Message(f"h/{unique}/in", b"ping", qos=1), wait=True)
            await asyncio.wait_for(held.wait(), 10)
    finally:
        listener.close()
    assert got == [b"ping"]


async def test_a_handler_may_publish_at_qos_0(mosquitto: ServerProcess, unique: str) -> None:
    """Inside paho's callback a QoS 0 publish waits for the writer (paho's callback lock is
    not reentrant: writing there would wait on the lock its own thread holds)."""
    settings = MqttSettings(port=mosquitto.port)
    echoes: asyncio.Queue[Message] = asyncio.Queue()
    async with (
        MqttTransport(settings, client_id=f"e-{unique}") as echo,
        MqttTransport(settings, client_id=f"c-{unique}") as caller,
    ):

        def answer(msg: Message) -> None:
            echo.publish_nowait(Message(f"echo/{unique}/out", msg.payload, qos=0))

        await echo.subscribe(f"echo/{unique}/in", answer, qos=0)
        await caller.subscribe(f"echo/{unique}/out", echoes.put_nowait, qos=0)
        for i in range(3):
            await caller.publish(Message(f"echo/{unique}/in", b"%d" % i, qos=1), wait=True)
            assert (await _next(echoes)).payload == b"%d" % i
