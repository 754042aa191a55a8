"""Durability of accepted jobs across crashes, from the transport up.

In-memory tier first: the memory transport's sessions and acknowledgements, which the
edge's crash tests stand on, behave like a persistent MQTT session. The real tier (an edge
agent process SIGKILLed mid-burst against a real Mosquitto) follows.
"""

from __future__ import annotations

import asyncio

from sluicegate.errors import TransportError
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.transport import Message


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_memory_session_redelivers_what_a_crashed_client_never_acked() -> None:
    broker = MemoryBroker()
    app = MemoryTransport(broker)
    edge = MemoryTransport(broker, client_id="edge", persistent=True)
    seen: list[Message] = []
    await edge.subscribe("jobs", seen.append, manual_ack=True)
    app.publish_nowait("jobs", b"a", qos=1)
    app.publish_nowait("jobs", b"b", qos=1)
    app.publish_nowait("jobs", b"fire-and-forget", qos=0)
    await _settle()
    assert [m.payload for m in seen] == [b"a", b"b", b"fire-and-forget"]
    edge.ack(seen[0])
    edge.ack(seen[2])  # QoS 0: nothing owed
    assert [m.payload for m in edge.unacked] == [b"b"]
    edge.crash()
    edge.ack(seen[1])  # too late: the connection is gone
    app.publish_nowait("jobs", b"c", qos=1)  # queued for the offline session
    app.publish_nowait("jobs", b"lost", qos=0)  # QoS 0 is not queued
    edge.publish_nowait("out", b"never sent", qos=1)
    again = MemoryTransport(broker, client_id="edge", persistent=True)
    seen2: list[Message] = []
    await again.subscribe("jobs", seen2.append, manual_ack=True)
    await _settle()
    assert [m.payload for m in seen2] == [b"b", b"c"]
    assert not [m for m in broker.log if m.topic == "out"]


async def test_clean_session_forgets_and_held_pubacks_fail_on_crash() -> None:
    broker = MemoryBroker(hold_pubacks=True)
    edge = MemoryTransport(broker, client_id="e")
    seen: list[Message] = []
    await edge.subscribe("jobs", seen.append, manual_ack=True)
    MemoryTransport(broker).publish_nowait("jobs", b"a", qos=1)
    pending = asyncio.ensure_future(edge.publish("r", b"x", qos=1, wait=True))
    await _settle()
    assert not pending.done()  # routed, but no PUBACK yet
    assert [m.topic for m in broker.log].count("r") == 1
    edge.crash()
    await _settle()
    assert isinstance(pending.exception(), TransportError)
    fresh = MemoryTransport(broker, client_id="e")
    seen2: list[Message] = []
    await fresh.subscribe("jobs", seen2.append, manual_ack=True)
    await _settle()
    assert seen2 == []
    done = asyncio.ensure_future(fresh.publish("r", b"y", qos=1, wait=True))
    await _settle()
    assert broker.release_pubacks() == 1
    await done
