"""In-memory tier: the edge agent's shell over the in-memory transport, with the real model.

Covers what is awkward to force over a real broker: a full queue, priority order, a
shutdown that still answers what was queued, and that one bad job never stops the rest.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from edge_agent.agent import EdgeAgent
from sluicegate import topics
from sluicegate.config import load_settings
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.transport import Message
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from tests.image_bytes import corrupt_jpeg, sample_jpeg

REGISTRY = ModelRegistry.from_dir(default_models_dir())
JPEG, TRUTH = sample_jpeg(11)


def _job(priority: int = 5, payload: bytes = JPEG, job_id: str | None = None) -> Message:
    props = [(topics.PROP_MODEL, "defect-v1"), (topics.PROP_PRIORITY, str(priority))]
    if job_id:
        props.append((topics.PROP_JOB_ID, job_id))
    return Message(
        topics.edge_submit("mem-edge"),
        payload,
        qos=1,
        response_topic="app/results",
        correlation_data=uuid.uuid4().bytes,
        content_type="image/jpeg",
        user_properties=tuple(props),
    )


async def _run_agent(
    queue_size: int, concurrency: int, messages: list[Message]
) -> tuple[list[dict[str, object]], EdgeAgent]:
    broker = MemoryBroker()
    settings = load_settings(
        edge={"id": "mem-edge", "queue_size": queue_size, "concurrency": concurrency}
    ).edge
    agent = EdgeAgent(settings, MemoryTransport(broker), REGISTRY)
    stop = asyncio.Event()
    runner = asyncio.ensure_future(agent.run(stop))
    await asyncio.wait_for(agent.ready.wait(), 10)
    for msg in messages:  # all admitted before any worker gets the loop
        agent.on_message(msg)
    stop.set()
    await asyncio.wait_for(runner, 30)
    results = [json.loads(m.payload) for m in broker.log if m.topic == "app/results"]
    return results, agent


async def test_full_queue_rejects_the_overflow_and_answers_the_rest() -> None:
    # One job runs at once, three may wait: of six submitted together, two are refused.
    results, agent = await _run_agent(3, 1, [_job(job_id=f"j{i}") for i in range(6)])
    by_id = {r["job_id"]: r for r in results}
    assert len(results) == 6
    assert [by_id[f"j{i}"]["status"] for i in range(6)] == ["ok"] * 4 + ["rejected"] * 2
    assert by_id["j5"]["code"] == "queue_full"
    assert "3 jobs queued" in str(by_id["j5"]["reason"])
    assert agent.results == {"ok": 4, "rejected": 2}


async def test_higher_priority_runs_first() -> None:
    # One compute thread: the jobs that wait for it are started by priority, not arrival.
    # "first" is the most urgent too, so whether it reaches the thread before "high" has
    # been counted behind it (a race with the commit) cannot change the order.
    msgs = [
        _job(9, job_id="first"),
        _job(1, job_id="low"),
        _job(8, job_id="high"),
        _job(5, job_id="mid"),
    ]
    results, _ = await _run_agent(10, 1, msgs)
    assert [r["job_id"] for r in results] == ["first", "high", "mid", "low"]


async def test_corrupt_image_is_rejected_and_the_next_job_still_runs() -> None:
    msgs = [_job(payload=corrupt_jpeg(), job_id="bad"), _job(job_id="good")]
    results, _ = await _run_agent(10, 1, msgs)
    by_id = {r["job_id"]: r for r in results}
    assert by_id["bad"]["status"] == "rejected"
    assert by_id["bad"]["code"] == "bad_image"
    assert by_id["good"]["status"] == "ok"
    assert by_id["good"]["outputs"]["label"] == TRUTH  # type: ignore[index]


async def test_jobs_arriving_during_shutdown_are_told_so() -> None:
    broker = MemoryBroker()
    settings = load_settings(edge={"id": "mem-edge"}).edge
    agent = EdgeAgent(settings, MemoryTransport(broker), REGISTRY)
    stop = asyncio.Event()
    runner = asyncio.ensure_future(agent.run(stop))
    await asyncio.wait_for(agent.ready.wait(), 10)
    stop.set()
    await asyncio.wait_for(runner, 30)
    agent.on_message(_job(job_id="late"))  # arrives after the agent stopped accepting
    late = await broker.wait_for(lambda m: m.topic == "app/results")
    assert json.loads(late.payload)["code"] == "shutting_down"
    statuses = [json.loads(m.payload)["state"] for m in broker.log if m.topic.endswith("status")]
    assert statuses == ["online", "offline"]


@pytest.mark.parametrize("bad_id", ["", "a/b", "#"])
def test_agent_refuses_an_id_that_breaks_topics(bad_id: str) -> None:
    settings = load_settings().edge.model_copy(update={"id": bad_id})
    with pytest.raises(ValueError, match="invalid edge id"):
        EdgeAgent(settings, MemoryTransport(MemoryBroker()), REGISTRY)
