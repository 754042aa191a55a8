"""Round trips through Mosquitto, logged in as the node: what ``sluicegate doctor`` times
to find a Mosquitto that delays small packets (Nagle's algorithm).

It logs in as :func:`sluicegate.doctor.judge_node.login_for` says (under TLS: the node's own
persistent session, never a clean start), subscribes to the node's probe topic only
(``topics.node_probe``, which nothing in the product reads), publishes there at QoS 1 (not
retained) and times each round trip: until both the PUBACK and the message itself are back.
The subscription is QoS 0 on purpose: Mosquitto then answers one publish with two small
packets and nothing from us in between, so without ``set_tcp_nodelay`` the second waits for
our delayed TCP ACK (~40 ms; measured 44 ms against 0.9 ms with nodelay), as a placement
reply would; with QoS 1 our own PUBACK of the delivery would carry that ACK and hide it.
Messages the node's session delivers meanwhile
match no subscription of this login, so the transport leaves them unacknowledged and
Mosquitto hands them to the node when it comes back. It unsubscribes before it
disconnects, leaving the session as it found it. Only the caller decides whether a login
is safe (the node must not be running).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from sluicegate import topics
from sluicegate.config import MqttSettings
from sluicegate.doctor.facts import RoundTrip
from sluicegate.doctor.judge_node import Login
from sluicegate.errors import TransportError
from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Message

ROUND_TRIPS = 9  # measured, after one to warm up
TIMEOUT_S = 5.0
# Few unacknowledged deliveries at once: the node's own queued work may come first, and
# it waits here (unacked) for the node.
RECEIVE_MAXIMUM = 16


async def round_trips(
    mqtt: MqttSettings, node: str, login: Login, *, count: int = ROUND_TRIPS
) -> RoundTrip:
    topic = topics.node_probe(node)
    transport = MqttTransport(
        mqtt,
        client_id=login.client_id,
        clean_start=login.clean_start,
        session_expiry_s=login.session_expiry_s,
        max_pending=RECEIVE_MAXIMUM,
    )
    try:
        await transport.connect(timeout=TIMEOUT_S)
    except TransportError as exc:
        return RoundTrip(topic, error=f"cannot log in as {login.client_id}: {exc}", stage="login")
    try:
        return await _measure(transport, topic, count)
    finally:
        await transport.close()


async def _measure(transport: MqttTransport, topic: str, count: int) -> RoundTrip:
    loop = asyncio.get_running_loop()
    pending: dict[bytes, asyncio.Future[None]] = {}

    def arrived(message: Message) -> None:
        waiting = pending.get(message.payload)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    try:
        await transport.subscribe(topic, arrived, qos=0)
    except TransportError as exc:
        return RoundTrip(topic, error=f"subscribing to {topic}: {exc}", stage="subscribe")
    nonce = uuid.uuid4().hex
    rtts: list[float] = []
    try:
        for n in range(count + 1):
            token = f"sluicegate doctor {nonce} {n}".encode()
            back = pending[token] = loop.create_future()
            start = time.perf_counter()
            try:
                await asyncio.wait_for(
                    asyncio.gather(
                        transport.publish(
                            Message(topic, token, qos=1, message_expiry_s=60), wait=True
                        ),
                        back,
                    ),
                    TIMEOUT_S,
                )
            except TransportError as exc:
                return RoundTrip(topic, error=f"publishing to {topic}: {exc}", stage="publish")
            except TimeoutError:
                return RoundTrip(
                    topic,
                    error=f"a message published to {topic} did not come back in {TIMEOUT_S:.0f} s",
                    stage="deliver",
                )
            finally:
                pending.pop(token, None)
            if n:
                rtts.append((time.perf_counter() - start) * 1000.0)
    finally:
        await transport.unsubscribe(topic)
    return RoundTrip(topic, tuple(rtts))
