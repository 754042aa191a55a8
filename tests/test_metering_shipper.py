"""The shipper over the in-memory transport: records out on the node's own usage topic once
durable, acknowledgements applied in the ledger, what is not acknowledged sent again, and
every unacknowledged record sent again by a restarted node."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies.keys import SigningKey
from sluicegate import topics
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.metering import shipper
from sluicegate.metering.ledger import Ledger
from sluicegate.metering.meter import Meter
from sluicegate.metering.wire import Refused, UsageAck, decode_batch
from sluicegate.transport import Message
from tests.support import until

KEY = SigningKey.generate()
NODE = "north-cpu-1"


def _seqs(message: Message) -> list[int]:
    return [r.record.seq for r in decode_batch(message.payload)]  # type: ignore[union-attr]


def _drafts(meter: Meter, n: int) -> list:  # type: ignore[type-arg]
    return [
        meter.ledger.draft(
            event="ran",
            job_id=f"j{i}",
            attempt=1,
            line="line-1-pc",
            zone="campus/dc",
            status="ok",
        )
        for i in range(n)
    ]


def _ack(held: list[int], refused: list[Refused] | None = None) -> Message:
    ack = UsageAck(node=NODE, broker="broker-1", held=held, refused=refused or [])
    return Message(topics.usage_acks(NODE), ack.model_dump_json().encode(), qos=1)


async def test_records_go_out_once_durable_and_acks_are_applied(tmp_path: Path) -> None:
    broker = MemoryBroker()
    meter = Meter(
        Ledger(tmp_path / "u.sqlite", KEY, node=NODE, kind="pool"),
        MemoryTransport(broker),
        resend_s=60.0,
    )
    await meter.start()
    signed = await meter.record(_drafts(meter, 3))
    sent = await broker.wait_for(lambda m: m.topic == topics.usage(NODE))
    assert _seqs(sent) == [1, 2, 3]
    assert decode_batch(sent.payload) == signed
    MemoryTransport(broker).publish_nowait(_ack([1, 2], [Refused(seq=3, code="x", reason="y")]))
    await until(lambda: meter.shipper.acked == 2)
    assert [s.record.seq for s in await meter.ledger.unacked()] == [3]
    assert meter.shipper.refused == 1
    await meter.stop()


async def test_records_written_one_job_at_a_time_share_a_message(tmp_path: Path) -> None:
    broker = MemoryBroker()
    meter = Meter(
        Ledger(tmp_path / "u.sqlite", KEY, node=NODE, kind="pool"),
        MemoryTransport(broker),
        resend_s=60.0,
    )
    await meter.start()
    for draft in _drafts(meter, 5):  # five jobs, each its own commit
        await meter.record([draft])

    def shipped() -> list[list[int]]:
        return [_seqs(m) for m in broker.log if m.topic == topics.usage(NODE)]

    await until(lambda: {seq for seqs in shipped() for seq in seqs} == {1, 2, 3, 4, 5})
    # The start's pass over the ledger may take the first; the rest share one message.
    assert len(shipped()) <= 2, shipped()
    await meter.stop()


async def test_what_is_not_acknowledged_is_sent_again(tmp_path: Path) -> None:
    broker = MemoryBroker()
    meter = Meter(
        Ledger(tmp_path / "u.sqlite", KEY, node=NODE, kind="pool"),
        MemoryTransport(broker),
        resend_s=0.2,
    )
    await meter.start()
    await meter.record(_drafts(meter, 2))
    shipped = [m for m in broker.log if m.topic == topics.usage(NODE)]

    def sent_twice() -> bool:
        return sum(1 for m in broker.log if m.topic == topics.usage(NODE)) > len(shipped)

    await until(sent_twice, timeout=5.0)
    assert _seqs(broker.log[-1]) == [1, 2]
    await meter.stop()


async def test_a_restarted_node_ships_every_unacknowledged_record(tmp_path: Path) -> None:
    path = tmp_path / "u.sqlite"
    broker = MemoryBroker()
    first = Meter(Ledger(path, KEY, node=NODE, kind="pool"), MemoryTransport(broker))
    await first.start()
    await first.record(_drafts(first, 4))
    MemoryTransport(broker).publish_nowait(_ack([1, 2]))
    await until(lambda: first.shipper.acked == 2)
    await first.stop()
    broker.log.clear()
    again = Meter(Ledger(path, KEY, node=NODE, kind="pool"), MemoryTransport(broker))
    await again.start()
    sent = await broker.wait_for(lambda m: m.topic == topics.usage(NODE))
    assert _seqs(sent) == [3, 4]
    more = await again.record(_drafts(again, 1))
    assert more[0].record.seq == 5
    await again.stop()


async def test_an_ack_for_another_node_or_malformed_changes_nothing(tmp_path: Path) -> None:
    broker = MemoryBroker()
    meter = Meter(
        Ledger(tmp_path / "u.sqlite", KEY, node=NODE, kind="pool"),
        MemoryTransport(broker),
        resend_s=60.0,
    )
    await meter.start()
    await meter.record(_drafts(meter, 1))
    other = UsageAck(node="cloud-cpu-1", broker="b", held=[1]).model_dump_json().encode()
    sender = MemoryTransport(broker)
    sender.publish_nowait(Message(topics.usage_acks(NODE), other, qos=1))
    sender.publish_nowait(Message(topics.usage_acks(NODE), b"{not json", qos=1))
    await until(lambda: meter.shipper.ignored == 2)
    assert [s.record.seq for s in await meter.ledger.unacked()] == [1]
    assert meter.shipper.acked == 0
    await meter.stop()


async def test_a_long_backlog_goes_out_over_several_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "u.sqlite"
    ledger = Ledger(path, KEY, node=NODE, kind="pool")
    await ledger.open()
    await ledger.append([ledger.draft(**_fields(i)) for i in range(7)])
    await ledger.close()
    monkeypatch.setattr(shipper, "PER_PASS", 3)
    monkeypatch.setattr(shipper, "PAGE", 2)
    broker = MemoryBroker()
    meter = Meter(Ledger(path, KEY, node=NODE, kind="pool"), MemoryTransport(broker), resend_s=0.2)
    await meter.start()

    seen: set[int] = set()

    def all_shipped(message: Message) -> bool:  # each message looked at once
        if message.topic == topics.usage(NODE):
            seen.update(_seqs(message))
        return seen == {1, 2, 3, 4, 5, 6, 7}

    await broker.wait_for(all_shipped, timeout=5.0)
    first = next(m for m in broker.log if m.topic == topics.usage(NODE))
    assert len(_seqs(first)) <= 3
    await meter.stop()


def _fields(i: int) -> dict[str, object]:
    return {
        "event": "ran",
        "job_id": f"b{i}",
        "attempt": 1,
        "line": "line-1-pc",
        "zone": "campus/dc",
        "status": "ok",
    }
