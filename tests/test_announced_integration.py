"""Announced work end to end on real Mosquitto: an app announces a burst to its edge with
the Python client and gets the edge's answer; a bad announcement is refused by name (the
edge serves on); the edge's retained book reaches a broker, whose pools' demand signal
rises before the window starts; a book from an edge the policy does not list, or naming
another edge than its topic, counts for nothing."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from sluicegate import topics, wire
from sluicegate.app.campus import LINES
from sluicegate.app.servers import ServerProcess, free_port
from sluicegate.client import Client
from sluicegate.config import load_settings
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from tests.image_bytes import sample_jpeg
from tests.support import AgentThread, PlainClient, installed_policy, wait_until
from tests.test_broker_params_integration import _campus, _get, _run_broker

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def edge(mosquitto: ServerProcess) -> Iterator[AgentThread]:
    settings = _edge_settings(mosquitto.port, f"edge-{uuid.uuid4().hex[:8]}")
    watcher = PlainClient(mosquitto.port)
    agent = AgentThread(settings, ModelRegistry.from_dir(default_models_dir()))
    agent.start(watcher)
    watcher.close()
    yield agent
    agent.stop()


def _edge_settings(port: int, edge_id: str) -> Any:
    return load_settings(
        mqtt={"port": port, "plaintext": True},
        offload={"policy_file": installed_policy()},
        edge={"id": edge_id, "zone": "campus/test/line-1"},
    )


@pytest.fixture
def app(mosquitto: ServerProcess, edge: AgentThread) -> Iterator[Client]:
    settings = load_settings(mqtt={"port": mosquitto.port, "plaintext": True})
    with Client(settings.mqtt, edge=edge.settings.edge.id, default_timeout=10) as client:
        yield client


def _book(watcher: PlainClient) -> dict[str, Any] | None:
    """The next retained book the watcher hears (None: cleared)."""
    got = watcher.next()
    return json.loads(got.payload) if got.payload else None


def test_an_app_announces_a_burst_and_the_edge_books_and_reports_it(
    mosquitto: ServerProcess, edge: AgentThread, app: Client
) -> None:
    watcher = PlainClient(mosquitto.port)
    watcher.subscribe(topics.edge_announced(edge.settings.edge.id))
    now = time.time()
    window = {"starts_at": now + 30, "ends_at": now + 90, "rate_per_s": 100.0}
    try:
        reply = app.announce(
            "recipe-42", model="defect-v1", reason="recipe 42 doubles the camera rate", **window
        )
        assert (reply.status, reply.announcement_id, reply.code) == ("accepted", "recipe-42", None)
        book = _book(watcher)
        assert book is not None
        assert book["node"] == edge.settings.edge.id
        (booked,) = book["windows"]
        assert booked["rate_per_s"] == 100.0
        assert booked["model"] == "defect-v1"
        assert booked["local_per_s"] >= 0.0
        gone = app.announce("recipe-42", model="defect-v1", withdraw=True, **window)
        assert gone.status == "withdrawn"
        assert _book(watcher) is None  # the retained book is cleared
    finally:
        watcher.close()


@pytest.mark.parametrize(
    ("kw", "code"),
    [
        ({"model": "no-such-model"}, "unknown_model"),
        ({"ends_at_offset": 10.0}, "bad_window"),
        ({"starts_offset": -100.0, "ends_at_offset": -50.0}, "window_over"),
    ],
)
def test_a_bad_announcement_is_refused_by_name(app: Client, kw: dict[str, Any], code: str) -> None:
    now = time.time()
    reply = app.announce(
        "bad-one",
        starts_at=now + kw.get("starts_offset", 30.0),
        ends_at=now + kw.get("ends_at_offset", 90.0),
        rate_per_s=50.0,
        model=kw.get("model", "defect-v1"),
    )
    assert (reply.status, reply.code) == ("refused", code)
    assert reply.reason


def test_a_malformed_announcement_is_refused_naming_the_field_and_the_edge_serves_on(
    mosquitto: ServerProcess, edge: AgentThread, app: Client
) -> None:
    sender = PlainClient(mosquitto.port)
    answers = f"tests/{uuid.uuid4().hex[:8]}/answers"
    sender.subscribe(answers)
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = answers
    props.CorrelationData = b"c-1"
    body = {"announcement_id": "x", "starts_at": 1.0, "ends_at": 2.0, "model": "defect-v1"}
    try:
        sender.client.publish(
            topics.edge_schedule(edge.settings.edge.id),
            json.dumps(body).encode(),
            qos=1,
            properties=props,
        ).wait_for_publish(10)
        got = sender.next()
    finally:
        sender.close()
    reply = wire.AnnouncementReply.model_validate_json(got.payload)
    assert got.correlation_data == b"c-1"
    assert (reply.status, reply.code) == ("refused", "bad_announcement")
    assert reply.reason is not None
    assert "rate_per_s" in reply.reason
    result = app.infer(sample_jpeg()[0], model="defect-v1", deadline_ms=5000)
    assert result.status == "ok"


def test_a_restarted_edge_clears_the_book_it_no_longer_holds(mosquitto: ServerProcess) -> None:
    edge_id = f"edge-{uuid.uuid4().hex[:8]}"
    stale = _schedule(edge_id, "campus/test/line-1", 30.0, "generic")
    publisher = PlainClient(mosquitto.port)
    topic = topics.edge_announced(edge_id)
    publisher.client.publish(topic, stale, qos=1, retain=True).wait_for_publish(10)
    publisher.subscribe(topic)
    assert publisher.next().payload == stale  # retained from before the restart
    starter = PlainClient(mosquitto.port)
    registry = ModelRegistry.from_dir(default_models_dir())
    agent = AgentThread(_edge_settings(mosquitto.port, edge_id), registry)
    agent.start(starter)
    try:
        assert publisher.next().payload == b""  # the edge cleared it as it started
    finally:
        agent.stop()
        starter.close()
        publisher.close()


def _schedule(node: str, zone: str, starts_in: float, data_class: str) -> bytes:
    now = time.time()
    window = wire.Announced(
        announcement_id="shift-2",
        starts_at=now + starts_in,
        ends_at=now + starts_in + 60,
        rate_per_s=200.0,
        model="defect-v1",
        data_class=data_class,
        local_per_s=20.0,
    )
    doc = wire.EdgeSchedule(node=node, zone=zone, ts=now, windows=[window])
    return doc.model_dump_json().encode()


def test_a_broker_counts_announced_work_in_its_pools_demand_before_the_window(
    tmp_path: Path, mosquitto: ServerProcess, fresh_redis_db: Callable[[], str]
) -> None:
    _, campus = _campus(tmp_path, mosquitto, fresh_redis_db())
    settings = load_settings(campus.node_config("broker-1"), broker={"http_port": free_port()})
    edge_id, zone = next(iter(LINES.items()))
    publisher = PlainClient(mosquitto.port)

    def put(topic_edge: str, payload: bytes) -> None:
        topic = topics.edge_announced(topic_edge)
        publisher.client.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)

    def announced() -> float:
        demand = _get(settings, "/policy")["demand"]
        return float(sum(d["announced_jobs_s"] for d in demand))

    thread = _run_broker(settings)
    try:
        assert announced() == 0.0
        # Another edge's name on this edge's topic, and an edge the policy does not list.
        put(edge_id, _schedule("line-9-pc", zone, 30.0, "ocr-crop"))
        put("line-9-pc", _schedule("line-9-pc", zone, 30.0, "ocr-crop"))
        put(edge_id, b"{not json")
        # A burst of 200 images/s in 30 s, the edge running 20 of them: 180/s for the pools
        # from now (the lead is 120 s), before the first image of it arrives.
        put(edge_id, _schedule(edge_id, zone, 30.0, "ocr-crop"))
        wait_until(lambda: announced() > 0.0)
        assert announced() == pytest.approx(180.0)
        ratio = {d["pool"]: d["ratio"] for d in _get(settings, "/policy")["demand"]}
        assert any(r > 1.0 for r in ratio.values())  # the scaling signal: add workers
        put(edge_id, _schedule(edge_id, zone, 600.0, "ocr-crop"))  # far ahead
        wait_until(lambda: announced() == 0.0)
        put(edge_id, b"")  # the book cleared
    finally:
        publisher.close()
        thread.stop()
