"""Durability of accepted jobs across crashes, from the transport up.

In-memory tier first: the memory transport's sessions and acknowledgements, which the
edge's crash tests stand on, behave like a persistent MQTT session. The real tier (an edge
agent process SIGKILLed mid-burst against a real Mosquitto) follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluicegate import topics, wire
from sluicegate.app.servers import ServerProcess
from sluicegate.client import AsyncClient
from sluicegate.config import MqttSettings
from sluicegate.errors import TransportError
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Message
from tests.edge_kit import APP_TOPIC, EDGE, JPEG, EdgeRig
from tests.image_bytes import sample_jpeg
from tests.support import PlainClient, start_agent_process, until


async def test_memory_session_redelivers_what_a_crashed_client_never_acked() -> None:
    broker = MemoryBroker()
    app = MemoryTransport(broker)
    edge = MemoryTransport(broker, client_id="edge", persistent=True)
    seen: list[Message] = []
    await edge.subscribe("jobs", seen.append, manual_ack=True)
    app.publish_nowait(Message("jobs", b"a", qos=1))
    app.publish_nowait(Message("jobs", b"b", qos=1))
    app.publish_nowait(Message("jobs", b"fire-and-forget", qos=0))
    await until(lambda: len(seen) == 3)
    assert [m.payload for m in seen] == [b"a", b"b", b"fire-and-forget"]
    edge.ack(seen[0])
    edge.ack(seen[2])  # QoS 0: nothing owed
    assert [m.payload for m in edge.unacked] == [b"b"]
    edge.crash()
    edge.ack(seen[1])  # too late: the connection is gone
    app.publish_nowait(Message("jobs", b"c", qos=1))  # queued for the offline session
    app.publish_nowait(Message("jobs", b"lost", qos=0))  # QoS 0 is not queued
    edge.publish_nowait(Message("out", b"never sent", qos=1))
    again = MemoryTransport(broker, client_id="edge", persistent=True)
    seen2: list[Message] = []
    await again.subscribe("jobs", seen2.append, manual_ack=True)
    app.publish_nowait(Message("jobs", b"after", qos=1))  # delivered after what was owed
    await until(lambda: seen2 and seen2[-1].payload == b"after")
    assert [m.payload for m in seen2] == [b"b", b"c", b"after"]
    assert [m.dup for m in seen2] == [True, False, False]  # only "b" was delivered before
    assert not [m for m in broker.log if m.topic == "out"]


async def test_clean_session_forgets_and_held_pubacks_fail_on_crash() -> None:
    broker = MemoryBroker(hold_pubacks=True)
    edge = MemoryTransport(broker, client_id="e")
    seen: list[Message] = []
    await edge.subscribe("jobs", seen.append, manual_ack=True)
    MemoryTransport(broker).publish_nowait(Message("jobs", b"a", qos=1))
    pending = asyncio.ensure_future(edge.publish(Message("r", b"x", qos=1), wait=True))
    await broker.wait_for(lambda m: m.topic == "r")
    assert not pending.done()  # routed, but no PUBACK yet
    assert [m.topic for m in broker.log].count("r") == 1
    edge.crash()
    with pytest.raises(TransportError):
        await asyncio.wait_for(pending, 5)
    fresh = MemoryTransport(broker, client_id="e")
    seen2: list[Message] = []
    await fresh.subscribe("jobs", seen2.append, manual_ack=True)
    MemoryTransport(broker).publish_nowait(Message("jobs", b"new", qos=1))
    await until(lambda: seen2)
    assert [m.payload for m in seen2] == [b"new"]  # "a" went with the clean session
    done = asyncio.ensure_future(fresh.publish(Message("r", b"y", qos=1), wait=True))
    assert await until(broker.release_pubacks) == 1  # the one PUBACK held back, sent now
    await asyncio.wait_for(done, 5)


# -- the agent over a real outbox file, crashed at chosen points ---------------------------


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def rig_factory(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> Iterator[Callable[..., EdgeRig]]:
    made: list[EdgeRig] = []

    def make(**options: Any) -> EdgeRig:
        rig = EdgeRig(loop, tmp_path / f"edge-{len(made)}.db", **options)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.stop()


def _stored_rows(db: Path) -> dict[str, tuple[str, int, int]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT job_id, state, attempt, local_runs FROM jobs").fetchall()
    return {job_id: (state, attempt, runs) for job_id, state, attempt, runs in rows}


@pytest.mark.parametrize("hold_pubacks", [False, True])
@pytest.mark.parametrize("crash_after", range(15))
def test_one_result_whatever_tick_the_edge_dies_at(
    rig_factory: Callable[..., EdgeRig], crash_after: int, hold_pubacks: bool
) -> None:
    rig = rig_factory(hold_pubacks=hold_pubacks)
    rig.start()
    rig.submit("job-1", correlation=b"c1")
    for _ in range(crash_after):
        rig.tick()
        rig.executor.run_all()
    rig.crash()
    published = any(m.topic == APP_TOPIC for m in rig.broker.log)  # the broker has it
    # The documented window: published, but the agent died before recording the PUBACK.
    window = published and _stored_rows(rig.db).get("job-1", ("",))[0] == "done"
    rig.start()
    rig.broker.release_pubacks()
    rig.settle()
    rig.broker.release_pubacks()
    rig.settle()
    assert rig.per_job() == {"job-1": 1 + window}  # a raw duplicate only from that window
    assert {r["status"] for r in rig.results()} == {"ok"}
    assert rig.agent is not None
    assert rig.agent.unfinished == 0
    assert rig.transport is not None
    assert rig.transport.unacked == []
    rig.crash()
    assert _stored_rows(rig.db)["job-1"][0] == "delivered"


def test_job_that_kills_the_edge_k_times_is_dead_lettered(
    rig_factory: Callable[..., EdgeRig],
) -> None:
    rig = rig_factory(max_local_runs=2)
    rig.start()
    rig.submit("poison", correlation=b"p")
    for _ in range(2):
        rig.settle(compute=False)  # its run starts and never ends: the edge dies in it
        assert len(rig.executor.held) == 1
        rig.crash()
        rig.start()
    rig.settle()
    (result,) = rig.results()
    assert (result["status"], result["code"]) == ("failed", "dead_letter")
    assert "started 2 times on edge" in result["reason"]
    assert rig.agent is not None
    assert rig.agent.counters["dead_letters"] == 1


def test_resubmitted_job_is_answered_from_the_outbox_not_run_again(
    rig_factory: Callable[..., EdgeRig],
) -> None:
    rig = rig_factory()
    rig.start()
    rig.submit(None, correlation=b"same")  # derived id: the same request, the same job
    rig.settle()
    rig.submit(None, correlation=b"same")
    rig.settle()
    first, again = rig.received
    assert first.payload == again.payload
    assert rig.agent is not None
    assert rig.agent.counters["accepted"] == 1
    assert rig.agent.counters["duplicates"] == 1
    rig.submit(None, correlation=b"other")  # a different request: a new job
    rig.settle()
    assert len(rig.per_job()) == 2


def test_resubmission_long_after_delivery_is_refused_by_its_tombstone(
    rig_factory: Callable[..., EdgeRig],
) -> None:
    rig = rig_factory()
    rig.start()
    rig.submit("j", correlation=b"1")
    rig.settle()
    assert rig.agent is not None
    rig.clock.now += rig.agent.outbox.result_retention_s + 1
    pruned = rig.call(rig.agent.outbox.prune)
    rig.settle()
    assert pruned.result() == (1, 0)
    rig.submit("j", correlation=b"2")
    rig.settle()
    refused = rig.results()[-1]
    assert (refused["status"], refused["code"]) == ("rejected", "duplicate_job")


def test_refused_requests_are_answered_but_not_stored(
    rig_factory: Callable[..., EdgeRig],
) -> None:
    rig = rig_factory()
    rig.start()
    rig.call(
        lambda: rig.app.publish_nowait(
            Message(
                topics.edge_submit(EDGE),
                b"not an image",
                qos=1,
                response_topic=APP_TOPIC,
                content_type="image/jpeg",
                user_properties=((topics.PROP_MODEL, "defect-v1"),),
            )
        )
    )
    rig.settle()
    (refusal,) = rig.results()
    assert refusal["status"] == "rejected"
    assert rig.transport is not None
    assert rig.transport.unacked == []  # answered, so acked
    rig.crash()
    assert _stored_rows(rig.db) == {}


def _placed_far(rig_factory: Callable[..., EdgeRig]) -> EdgeRig:
    """A running offloading edge whose job "far" is sent to its worker as attempt 1."""
    rig = rig_factory(offload=True)
    rig.start()
    rig.submit("far", correlation=b"f")
    rig.settle()
    assert rig.placement is not None
    assert rig.placement.sent == [("far", 1)]
    return rig


def test_offloaded_job_waits_for_its_return_across_a_restart(
    rig_factory: Callable[..., EdgeRig],
) -> None:
    rig = _placed_far(rig_factory)
    rig.crash()
    rig.give_back("far", 1)  # the worker answers while the edge is down: the session keeps it
    rig.start()
    rig.settle()
    (result,) = rig.results()
    assert result["ran_on"]["kind"] == "pool"
    assert rig.agent is not None
    assert rig.agent.counters["replayed"] == 1


def test_offloaded_job_is_offered_again_after_the_timeout_following_a_restart(
    rig_factory: Callable[..., EdgeRig],
) -> None:
    rig = rig_factory(offload=True)
    rig.start()
    rig.submit("far", correlation=b"f")
    rig.settle()
    rig.crash()
    agent = rig.start()
    rig.clock.now += 10.0
    rig.call(agent.check_offloaded)
    rig.settle()
    assert rig.placement is not None
    assert rig.placement.sent == [("far", 1), ("far", 2)]
    rig.give_back("far", 1)  # the first worker, too late: fenced
    rig.give_back("far", 2)
    rig.settle()
    assert rig.per_job() == {"far": 1}
    assert agent.counters["fenced_returns"] == 1


def test_crash_after_the_work_went_out_before_its_commit_loses_nothing(
    rig_factory: Callable[..., EdgeRig],
) -> None:
    """A placement answered during the acceptance commit has its work sent at once. A crash
    before the commit lands leaves a worker running a job the edge never accepted: the
    request is delivered again, the job placed again under the same attempt number, and
    the app still gets one result whichever worker answers first."""
    rig = rig_factory(offload=True)
    placement = rig.placement
    assert placement is not None
    rig.start()
    rig.submit("far", correlation=b"f")
    for _ in range(10):  # loop iterations only: the outbox's writer is given nothing
        if placement.sent:
            break
        rig.loop.stop()
        rig.loop.run_forever()
    assert placement.early == [("far", 1)]
    rig.crash(before_commit=True)
    assert "far" not in _stored_rows(rig.db)
    rig.start()  # never acked: the session delivers the request again
    rig.settle()
    assert placement.sent == [("far", 1), ("far", 1)]
    rig.give_back("far", 1)  # the first worker's return, then the second's
    rig.give_back("far", 1)
    rig.settle()
    (result,) = rig.results()
    assert (result["status"], result["ran_on"]["kind"]) == ("ok", "pool")
    assert rig.agent is not None
    assert rig.agent.unfinished == 0


@pytest.mark.parametrize("committed", [False, True], ids=["before-commit", "after-commit"])
def test_crash_while_the_placement_is_asked_and_the_job_committed_loses_nothing(
    rig_factory: Callable[..., EdgeRig], committed: bool
) -> None:
    rig = rig_factory(offload=True)
    placement = rig.placement
    assert placement is not None
    placement.slow = True  # the broker's answer waits: the job goes no further
    rig.start()
    rig.submit("far", correlation=b"f")
    for _ in range(10):  # until the edge has asked for its placement
        if placement.asked:
            break
        rig.tick()
    assert placement.asked == [("far", 1)]
    rig.crash(before_commit=not committed)
    assert ("far" in _stored_rows(rig.db)) == committed
    assert placement.answer_all() == 1  # answered, but nobody is there to take it
    rig.start()  # never acked: the session delivers the request again
    placement.slow = False
    rig.settle()
    # Asked again: as a new job (not committed), or replayed from the outbox (committed).
    assert placement.asked == [("far", 1), ("far", 1)]
    assert placement.sent == [("far", 1)]
    assert placement.early == []
    rig.give_back("far", 1)
    rig.settle()
    (result,) = rig.results()
    assert (result["status"], result["ran_on"]["kind"]) == ("ok", "pool")
    assert rig.agent is not None
    assert rig.agent.counters["accepted"] == (0 if committed else 1)
    assert rig.agent.counters["replayed"] == (1 if committed else 0)
    assert rig.transport is not None
    assert rig.transport.unacked == []


# -- the Python client drops a result published again after an edge restart -------------


@pytest.mark.integration
async def test_client_hands_over_one_result_per_job_and_counts_the_repeat(
    mosquitto: ServerProcess, unique: str
) -> None:
    settings = MqttSettings(port=mosquitto.port)
    edge_id = f"dup-{unique}"

    def answer_twice(msg: Message) -> None:
        result = wire.JobResult(
            job_id=msg.user_property(topics.PROP_JOB_ID) or "derived",
            status="ok",
            ran_on=wire.RanOn(kind="edge", node=edge_id, zone="campus/x"),
        )
        assert msg.response_topic is not None
        for _ in range(2):  # as an edge that died between the PUBACK and recording it
            fake_edge.publish_nowait(
                Message(
                    msg.response_topic,
                    wire.dump(result),
                    qos=1,
                    correlation_data=msg.correlation_data,
                )
            )

    async with (
        MqttTransport(settings, client_id=f"fake-{unique}") as fake_edge,
        AsyncClient(settings, edge=edge_id, remember=2) as client,
    ):
        await fake_edge.subscribe(topics.edge_submit(edge_id), answer_twice)
        first = await client.infer(JPEG, model="defect-v1", job_id="j-1", timeout=10)
        second = await client.infer(JPEG, model="defect-v1", job_id="j-2", timeout=10)
        # Asking for j-1 again is a new call: it gets its answer.
        again = await client.infer(JPEG, model="defect-v1", job_id="j-1", timeout=10)
        await client.infer(JPEG, model="defect-v1", job_id="j-3", timeout=10)
    assert (first.job_id, second.job_id, again.job_id) == ("j-1", "j-2", "j-1")
    # Each call's repeat arrived after its result: dropped and counted (the repeat of the
    # last may still be on its way when the client closes).
    assert client.duplicates >= 3
    assert client.unmatched == 0


# -- a real edge agent process, SIGKILLed mid-burst ----------------------------------------


def _done_rows(db: Path) -> int:
    """Results committed but not recorded delivered: the only ones that may come twice."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM jobs WHERE state = 'done'").fetchone()[0])


def _wait_status(watcher: PlainClient, edge_id: str, state: bytes) -> None:
    while True:
        got = watcher.next(timeout=20)
        if got.topic == topics.edge_status(edge_id) and state in got.payload:
            return


@pytest.mark.integration
def test_sigkilled_edge_answers_every_acked_job_once_after_restart(
    mosquitto: ServerProcess, tmp_path: Path, unique: str
) -> None:
    edge_id = f"kill-{unique}"
    db = tmp_path / "outbox.db"
    config = tmp_path / "edge.toml"
    config.write_text(f'[edge]\noutbox_path = "{db}"\nconcurrency = 2\nqueue_size = 1000\n')
    response_topic = f"tests/{unique}/results"
    app = PlainClient(mosquitto.port)
    app.subscribe(response_topic)
    watcher = PlainClient(mosquitto.port)
    watcher.subscribe(topics.edge_status(edge_id))
    images = [sample_jpeg(seed)[0] for seed in range(4)]
    raw: Counter[str] = Counter()

    def submit(job_ids: list[str]) -> None:
        for i, job_id in enumerate(job_ids):  # each returns once Mosquitto PUBACKed it
            app.submit(
                edge_id,
                images[i % len(images)],
                response_topic=response_topic,
                correlation=job_id.encode(),
                user=[(topics.PROP_MODEL, "defect-v1"), (topics.PROP_JOB_ID, job_id)],
            )

    def collect(until: Callable[[], bool], timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            got = app.next(timeout=max(0.1, deadline - time.monotonic()))
            doc = json.loads(got.payload)
            assert doc["status"] == "ok", doc
            raw[doc["job_id"]] += 1

    first = [f"a{i}" for i in range(200)]
    later = [f"b{i}" for i in range(100)]
    agent = start_agent_process(mosquitto.port, edge_id, "--config", str(config))
    try:
        submit(first)
        collect(lambda: len(raw) >= 40)  # mid-burst: most of the first 200 not answered yet
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        _wait_status(watcher, edge_id, b'"offline"')  # its Last Will
        may_repeat = _done_rows(db)
        submit(later)  # acked by Mosquitto while the edge is down: queued for its session
        agent = start_agent_process(mosquitto.port, edge_id, "--config", str(config))
        everyone = set(first) | set(later)
        collect(lambda: set(raw) >= everyone)
        # A last job: once it is answered, any repeat published on restart has arrived too.
        submit(["barrier"])
        collect(lambda: "barrier" in raw)
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(20)
        app.close()
        watcher.close()
    repeats = sum(raw.values()) - len(raw)
    print(
        f"\n{len(everyone)} jobs acked, {len(raw) - 1} answered, {repeats} repeats (at most "
        f"{may_repeat}: committed, not recorded delivered at the kill)"
    )
    assert set(raw) == everyone | {"barrier"}
    assert repeats <= may_repeat


def test_a_forwarded_result_lost_before_its_commit_goes_out_again_the_same(
    rig_factory: Callable[..., EdgeRig],
) -> None:
    """A return whose attempt is on disk reaches the app before its commit; a crash in
    between leaves the return unacked, so the restarted edge gets it again and sends the
    very same bytes: a repeat the client drops, never a second, different result."""
    rig = _placed_far(rig_factory)
    rig.give_back("far", 1)
    for _ in range(10):  # until the result is out; its commit is given no writer meanwhile
        if rig.received:
            break
        rig.loop.stop()  # one turn of the loop, without the tick's release of the writes
        rig.loop.run_forever()
    assert len(rig.received) == 1
    rig.crash(before_commit=True)
    assert _stored_rows(rig.db)["far"][:2] == ("offloaded", 1)  # published, not committed
    rig.start()
    rig.settle()
    first, again = rig.received
    assert again.payload == first.payload
    assert json.loads(first.payload)["ran_on"]["kind"] == "pool"
    assert rig.agent is not None
    assert rig.agent.unfinished == 0
    assert rig.transport is not None
    assert rig.transport.unacked == []
    rig.crash()
    assert _stored_rows(rig.db)["far"][0] == "delivered"
