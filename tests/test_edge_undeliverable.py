"""A result the edge may not deliver, on a secured Mosquitto (TLS, client certificates, the
ACL generated from the signed policy) with a real edge agent:

* an edge that does not offload still holds the policy, so a job whose Response Topic is
  outside its apps' results prefixes is refused before it is accepted;
* an edge given no policy at all accepts such a job; Mosquitto refuses its result (PUBACK
  "Not authorized"); the job ends there, counted, and is never published again, across a
  restart, while the edge goes on serving everyone else; a refusal the broker refuses acks
  its request all the same.
"""

from __future__ import annotations

import json
import queue
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_agent.outbox import Outbox
from sluicegate import topics, wire
from sluicegate.app.campus import Campus
from sluicegate.config import Settings, load_settings
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from tests.image_bytes import sample_jpeg
from tests.secure_kit import TlsClient
from tests.support import AgentThread, local_campus, wait_until

pytestmark = pytest.mark.integration

EDGE, APP, OTHER_APP = "line-1-pc", "app-line-1", "app-line-2"
FOREIGN = "app/line-2/stolen"  # app-line-2's prefix: the ACL lets line-1-pc publish nowhere here
REGISTRY = ModelRegistry.from_dir(default_models_dir())


@pytest.fixture(scope="module")
def campus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Campus]:
    """The campus's files and its secured Mosquitto; no other node runs."""
    nowhere = "redis://127.0.0.1:1/0"  # nothing here talks to Redis
    with local_campus(tmp_path_factory.mktemp("undeliverable"), nowhere, start=False) as lc:
        yield lc.write()


def _settings(campus: Campus, outbox: Path, *, policy: bool = True) -> Settings:
    """line-1-pc's configuration with offload off; without ``policy``, none given at all."""
    settings = load_settings(
        campus.node_config(EDGE),
        edge={"outbox_path": str(outbox), "telemetry_interval_s": 0.2},
        offload={"enabled": False},
    )
    if policy:
        return settings
    bare = settings.offload.model_copy(update={"policy_file": None, "state_dir": None})
    return settings.model_copy(update={"offload": bare})


def _submit(app: TlsClient, response_topic: str, job_id: str) -> None:
    image = sample_jpeg(3)[0]
    user = [(topics.PROP_MODEL, "defect-v1"), (topics.PROP_JOB_ID, job_id)]
    ack = app.publish(topics.edge_submit(EDGE), image, response_topic=response_topic, user=user)
    assert not ack.is_failure, ack


def _events(watcher: TlsClient, wanted: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """The events of the first telemetry of the edge that satisfies ``wanted``."""

    def seen() -> dict[str, int] | None:
        got = watcher.get(timeout=5)
        if got.topic != topics.edge_telemetry(EDGE):
            return None
        events = dict(wire.EdgeTelemetry.model_validate_json(got.payload).events)
        return events if wanted(events) else None

    found: dict[str, int] = wait_until(seen, timeout=20)
    return found


def _served(app: TlsClient, tag: str) -> None:
    """The edge still answers a job whose result it may deliver."""
    job_id = f"ok-{tag}-{uuid.uuid4().hex[:6]}"
    _submit(app, f"app/line-1/{tag}", job_id)
    result = json.loads(app.get(timeout=20).payload)
    assert (result["job_id"], result["status"]) == (job_id, "ok")


def test_an_edge_that_does_not_offload_still_refuses_an_answer_it_could_not_deliver(
    campus: Campus, tmp_path: Path
) -> None:
    app, victim, watcher = (
        TlsClient(campus, APP),
        TlsClient(campus, OTHER_APP),
        TlsClient(campus, "observer"),
    )
    agent = AgentThread(_settings(campus, tmp_path / "edge.db"), REGISTRY)
    try:
        app.subscribe("app/line-1/#")
        victim.subscribe("app/line-2/#")
        agent.start(watcher)
        watcher.subscribe(topics.edge_telemetry(EDGE))
        _submit(app, FOREIGN, "stolen-1")
        events = _events(watcher, lambda e: e.get("response_topic_not_allowed", 0) >= 1)
        assert events.get("accepted", 0) == 0
        _served(app, "after")
        with pytest.raises(queue.Empty):
            victim.get(timeout=0.3)
    finally:
        agent.stop()
        for client in (app, victim, watcher):
            client.close()


def test_a_result_the_broker_refuses_ends_its_job_counted_and_is_never_sent_again(
    campus: Campus, tmp_path: Path
) -> None:
    outbox = tmp_path / "edge.db"
    settings = _settings(campus, outbox, policy=False)
    app, victim, watcher = (
        TlsClient(campus, APP),
        TlsClient(campus, OTHER_APP),
        TlsClient(campus, "observer"),
    )
    app.subscribe("app/line-1/#")
    victim.subscribe("app/line-2/#")
    watcher.subscribe(topics.edge_telemetry(EDGE))
    try:
        agent = AgentThread(settings, REGISTRY)
        agent.start(watcher)
        _submit(app, FOREIGN, "stolen-2")
        # A request refused here (a model this edge does not have) whose refusal the broker
        # refuses too: acked all the same, or Mosquitto would hand it over at every restart.
        bad = [(topics.PROP_MODEL, "no-such-model"), (topics.PROP_JOB_ID, "stolen-bad")]
        image = sample_jpeg(3)[0]
        app.publish(topics.edge_submit(EDGE), image, response_topic=FOREIGN, user=bad)
        events = _events(watcher, lambda e: e.get("results_refused", 0) >= 2)
        assert events.get("accepted", 0) == 1  # without the policy it could not know
        _served(app, "first")
        agent.stop()

        box = Outbox(outbox)
        pending = _run(box.open())
        _run(box.close())
        assert pending == []  # nothing left to run or publish: the job ended

        again = AgentThread(settings, REGISTRY)  # a restart publishes nothing again
        again.start(watcher)
        _served(app, "second")
        events = _events(watcher, lambda e: "republished" in e or "accepted" in e)
        assert events.get("republished", 0) == 0
        assert events.get("results_refused", 0) == 0
        again.stop()
        with pytest.raises(queue.Empty):
            victim.get(timeout=0.3)
    finally:
        for client in (app, victim, watcher):
            client.close()


def _run(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)
