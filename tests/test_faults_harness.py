"""The fault-injection harness itself: the verdict's arithmetic (pure), the link proxy's cut
and heal against a real Mosquitto, and hand-encoded MQTT packets as a real client sees them.

These are quick and need no campus; if one fails, the fault tests' findings cannot be
trusted either.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import pytest

from sluicegate.app.servers import ServerProcess
from sluicegate.config import MqttSettings
from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Message
from tests.faults.ledger import Ledger
from tests.faults.malformed import KINDS, Flooder, connect_packet, publish_packet
from tests.faults.proxy import LinkProxy

PINGREQ, PINGRESP = b"\xc0\x00", b"\xd0\x00"


def _result(job_id: str, status: str = "ok", node: str = "line-1-pc") -> bytes:
    doc = {"v": 1, "job_id": job_id, "status": status, "ran_on": {"kind": "edge", "node": node}}
    return json.dumps(doc).encode()


def test_verdict_counts_lost_duplicated_raw_duplicates_and_unexpected() -> None:
    ledger = Ledger()
    for n, job_id in enumerate(["a", "b", "c", "d", "e"]):
        ledger.published(job_id, "line-1-pc", float(n))
        if job_id != "e":
            ledger.acked(job_id, float(n))
    ledger.delivered(_result("a"), b"a", 10.0)
    ledger.delivered(_result("a"), b"a", 11.0)  # the same result again: a raw duplicate
    ledger.delivered(_result("b"), b"b", 10.0)
    ledger.delivered(_result("b", node="north-cpu-1"), b"b", 12.0)  # a second answer
    ledger.delivered(_result("zz"), b"zz", 12.0)  # never submitted
    ledger.published("c", "line-1-pc", 20.0)  # the app resubmitted c
    verdict = ledger.verdict()
    assert verdict.accepted == 4
    assert verdict.unaccepted == 1  # e was never acked, so it is owed nothing
    assert verdict.lost == ["c", "d"]
    assert list(verdict.duplicated) == ["b"]
    assert verdict.raw_duplicates == 1
    assert verdict.unexpected == 1
    assert verdict.resubmits == 1
    assert not verdict.ok
    assert "ran_on" in verdict.explain()


@pytest.fixture
def proxy(mosquitto: ServerProcess) -> Iterator[LinkProxy]:
    with LinkProxy(mosquitto.port) as proxy:
        yield proxy


def _mqtt_connect(port: int, name: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(connect_packet(name, keepalive_s=60))
    return sock


def _silent(sock: socket.socket, wait_s: float = 0.3) -> bool:
    """True if nothing (not even a close) arrives within ``wait_s``."""
    sock.settimeout(wait_s)
    try:
        sock.recv(64)
    except TimeoutError:
        return True
    return False


@pytest.mark.integration
def test_blackhole_cut_silences_both_ways_and_heal_forwards_again(proxy: LinkProxy) -> None:
    old = _mqtt_connect(proxy.port, "proxy-old")
    assert old.recv(64)[:1] == b"\x20"  # CONNACK through the proxy
    proxy.cut("blackhole")
    old.sendall(PINGREQ)
    assert _silent(old)  # no PINGRESP, and no close either: only keepalive can tell
    fresh = _mqtt_connect(proxy.port, "proxy-new")  # accepted, then ignored
    assert _silent(fresh)
    assert proxy.discarded_bytes > 0
    proxy.heal()
    old.settimeout(5)
    assert old.recv(64) == b""  # black-holed links are closed on heal
    again = _mqtt_connect(proxy.port, "proxy-again")
    again.settimeout(5)
    assert again.recv(64)[:1] == b"\x20"
    for sock in (old, fresh, again):
        sock.close()


@pytest.mark.integration
def test_drop_cut_refuses_connections_until_heal(proxy: LinkProxy) -> None:
    live = _mqtt_connect(proxy.port, "proxy-live")
    assert live.recv(64)[:1] == b"\x20"
    proxy.cut("drop")
    live.settimeout(5)
    assert live.recv(64) == b""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    proxy.heal()
    back = _mqtt_connect(proxy.port, "proxy-back")
    back.settimeout(5)
    assert back.recv(64)[:1] == b"\x20"
    live.close()
    back.close()


@pytest.mark.integration
def test_hand_encoded_publish_reaches_a_real_client_with_its_properties(
    mosquitto: ServerProcess, unique: str
) -> None:
    async def run() -> Message:
        got: asyncio.Queue[Message] = asyncio.Queue()
        sub = MqttTransport(MqttSettings(port=mosquitto.port), client_id=f"sub-{unique}")
        await sub.connect()
        await sub.subscribe(f"t/{unique}", got.put_nowait)
        sock = _mqtt_connect(mosquitto.port, f"raw-{unique}")
        assert sock.recv(64)[:1] == b"\x20"
        sock.sendall(
            publish_packet(
                f"t/{unique}",
                b"\xff\xd8\xff",
                response_topic="r/1",
                correlation=b"c-1",
                content_type="image/jpeg",
                user=[("model", "defect-v1"), (b"deadline-ms", b"-5")],
            )
        )
        try:
            return await asyncio.wait_for(got.get(), 10)
        finally:
            sock.close()
            await sub.close()

    msg = asyncio.run(run())
    assert msg.payload == b"\xff\xd8\xff"
    assert (msg.response_topic, msg.correlation_data, msg.content_type) == (
        "r/1",
        b"c-1",
        "image/jpeg",
    )
    assert msg.user_properties == (("model", "defect-v1"), ("deadline-ms", "-5"))


@pytest.mark.integration
def test_flooder_sends_every_kind_and_mosquitto_drops_bad_utf8(
    mosquitto: ServerProcess, unique: str
) -> None:
    flooder = Flooder(
        mosquitto.port, f"flood-{unique}", rate=1000, reply_topic="r", payload_limit=2048
    )
    flooder.run_for(1.0)
    flooder.join(20)
    assert set(flooder.sent) == {k.name for k in KINDS}
    # A user property that is not UTF-8 is a protocol error: Mosquitto closes that connection.
    assert flooder.dropped_connections["bad"] >= 1
    assert flooder.dropped_connections["main"] == 0
