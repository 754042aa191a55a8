"""A sister campus's work on a pool worker (issue 39, part 4): the image crosses the bridge in
a ``wire_peer`` envelope on ``topics.peer_work`` (no MQTT property crosses a 3.1.1 bridge);
the worker unwraps it, checks the token with the peer as its origin (``peer:<campus>``,
whatever the message says), runs it, and returns the result in an envelope on
``topics.peer_returns`` to that campus's edge. In-memory transport, the real model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest_asyncio

from policies.evaluate import peer_origin
from sluicegate import topics
from sluicegate.memory_transport import MemoryTransport
from sluicegate.transport import Message
from sluicegate.wire_peer import unwrap, wrap
from tests.policies.policy_testkit import key, policy_of
from tests.pool_kit import EDGE, JPEG, TRUTH, WORKER, WORKER_ZONE, WorkSpec, policy_doc, token
from tests.test_pool_memory import Harness, start

EAST = "east-site"  # the sister campus whose edge sends the work
EAST_EDGE = "east-pc-1"
OPEN = policy_of(
    {
        **policy_doc(version=2),  # after the version the worker's enrollment pinned
        "peers": {
            EAST: {
                "ca_fingerprint": "sha256:" + "3" * 64,
                "brokers": {"east-broker-1": key("east-broker-1").public_text},
                "officers": {"threshold": 1, "keys": {"e": key("east-officer").public_text}},
                "receive": {"classes": ["wafer-image"], "zones": [WORKER_ZONE]},
            }
        },
    }
)
BACK = topics.peer_returns("acme", EAST, EAST_EDGE, WORKER)


def peer_work(job_id: str, *, origin: str = peer_origin(EAST), **spec: Any) -> Message:
    """What east's edge sends: the work message, wrapped, on east's tree to this campus."""
    tok = token(job_id, JPEG, policy=OPEN, origin=origin)
    on_campus = WorkSpec(job_id=job_id, token=tok, edge=EAST_EDGE, **spec).message()
    topic = topics.peer_work(EAST, "acme", WORKER, EAST_EDGE)
    return wrap(Message(topic, on_campus.payload, qos=1, **_props(on_campus)))


def _props(msg: Message) -> dict[str, Any]:
    return {
        "correlation_data": msg.correlation_data,
        "content_type": msg.content_type,
        "user_properties": msg.user_properties,
    }


def publish(pool: Harness, msg: Message) -> None:
    MemoryTransport(pool.broker).publish_nowait(msg)


@pytest_asyncio.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start(tmp_path, published=OPEN)
    yield harness
    await harness.close()


async def returned(pool: Harness, job_id: str) -> tuple[Message, dict[str, Any]]:
    wrapped = await pool.broker.wait_for(
        lambda m: m.topic == BACK and unwrap(m).user_property(topics.PROP_JOB_ID) == job_id
    )
    back = unwrap(wrapped)
    return back, json.loads(back.payload)


async def test_a_peer_s_work_runs_and_its_result_goes_back_across_in_an_envelope(
    pool: Harness,
) -> None:
    publish(pool, peer_work("east-job-1", attempt="2", correlation=b"east-app"))
    back, result = await returned(pool, "east-job-1")
    assert result["status"] == "ok", result
    assert result["outputs"]["label"] == TRUTH
    assert dict(back.user_properties) == {
        topics.PROP_JOB_ID: "east-job-1",
        topics.PROP_ATTEMPT: "2",
        topics.PROP_WORKER: WORKER,
    }
    assert back.correlation_data == b"east-app"
    done = await pool.broker.wait_for(lambda m: m.topic == topics.completion(WORKER))
    record = json.loads(done.payload)
    assert (record["job_id"], record["edge_id"], record["status"]) == (
        "east-job-1",
        EAST_EDGE,
        "ok",
    )
    # Nothing of it went to an on-campus edge's returns topic.
    assert not [m for m in pool.broker.log if m.topic.startswith(topics.edge_returns("", ""))]


async def test_a_token_minted_for_an_on_campus_edge_is_refused_back_across(
    pool: Harness,
) -> None:
    """A peer's edge cannot use a placement made for one of this campus's lines: the origin
    is the campus whose bridge wrote the topic."""
    publish(pool, peer_work("east-job-2", origin="campus/fab-north/line-1"))
    _back, result = await returned(pool, "east-job-2")
    assert (result["status"], result["code"]) == ("rejected", "token.wrong_origin")
    assert pool.worker.decode_attempts == 0


async def test_a_message_that_is_no_envelope_is_counted_and_the_worker_serves_on(
    pool: Harness,
) -> None:
    plain = WorkSpec(job_id="east-job-3", edge=EAST_EDGE).message()
    topic = topics.peer_work(EAST, "acme", WORKER, EAST_EDGE)
    publish(pool, Message(topic, plain.payload, qos=1, **_props(plain)))
    publish(pool, peer_work("east-job-4"))
    _back, result = await returned(pool, "east-job-4")
    assert result["status"] == "ok"
    assert pool.worker.peer_envelopes_refused == 1
    assert not [m for m in pool.broker.log if m.topic == BACK and b"east-job-3" in m.payload]


async def test_a_worker_whose_zone_no_peer_may_use_takes_no_peer_work(tmp_path: Path) -> None:
    closed = await start(tmp_path)  # the policy names no sister campus
    try:
        publish(closed, peer_work("east-job-5"))
        on_campus = closed.send(WorkSpec(job_id="local-1", edge=EDGE))
        assert (await closed.result_for(on_campus))["status"] == "ok"
        assert not [m for m in closed.broker.log if m.topic == BACK]
    finally:
        await closed.close()
