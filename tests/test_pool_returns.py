"""Real tier: a pool worker returns each result to the edge that sent the job, under its own
worker id, never to the app's topic, and refuses before decoding a work message whose topic
names no edge or whose edge the policy does not list.

A real worker (MQTT transport, ONNX Runtime, Redis replay cache and audit stream) against
its own Mosquitto and the session's redis-server, driven by a bare paho client that reads
the user properties the worker sets, as the edge agent does when it fences a return.
"""

from __future__ import annotations

import json
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import paho.mqtt.client as paho
import pytest
import redis
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from center_pool.service import serve
from policies import verify_chain
from policies.audit import decode_record
from policies.redis_stores import RedisStreamAuditStore, audit_stream_key
from sluicegate import topics
from sluicegate.app.servers import ServerProcess, running, start_mosquitto
from sluicegate.config import load_settings
from sluicegate.transport import Message
from tests.pool_kit import SPARE_EDGES, TRUTH, WORKER, WORKER_ZONE, WorkSpec, write_policy_file
from tests.support import PlainClient, ServiceThread

pytestmark = pytest.mark.integration

APP_TOPIC = "tests/app/results"  # what an app asked for: the worker must not use it
COMPLETIONS = topics.completion(WORKER)
_next_edge = iter(SPARE_EDGES)  # each test sends as an edge of its own


@dataclass(frozen=True)
class Got:
    topic: str
    payload: bytes
    qos: int
    correlation_data: bytes | None
    user_properties: dict[str, str]


class Edge:
    """A bare paho client in the role of the edge agent ``edge_id``: sends work messages
    and reads its returns topics (and the app topic and completions, to see what else goes
    out), keeping each message's user properties."""

    def __init__(self, port: int, edge_id: str) -> None:
        self.edge_id = edge_id
        self.inbox: queue.Queue[Got] = queue.Queue()
        self._subacks: queue.Queue[int] = queue.Queue()
        connected = threading.Event()
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=f"edge-{edge_id}", protocol=paho.MQTTv5
        )
        self.client.on_connect = lambda *_: connected.set()
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda _c, _u, mid, _rc, _p: self._subacks.put(mid)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert connected.wait(10)
        for topic in (topics.edge_returns_all(edge_id), APP_TOPIC, topics.completions_all()):
            _rc, mid = self.client.subscribe(topic, qos=1)
            while self._subacks.get(timeout=10) != mid:
                pass

    def _on_message(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        props = msg.properties
        self.inbox.put(
            Got(
                msg.topic,
                bytes(msg.payload),
                msg.qos,
                getattr(props, "CorrelationData", None),
                dict(getattr(props, "UserProperty", None) or []),
            )
        )

    def send(self, msg: Message) -> None:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = APP_TOPIC  # as an older edge set it: ignored now
        if msg.correlation_data is not None:
            props.CorrelationData = msg.correlation_data
        if msg.content_type is not None:
            props.ContentType = msg.content_type
        props.UserProperty = list(msg.user_properties)
        info = self.client.publish(msg.topic, msg.payload, qos=1, properties=props)
        info.wait_for_publish(10)

    def until_completion(self, job_id: str) -> list[Got]:
        """Everything received up to and including the completion record of ``job_id``:
        the worker publishes a job's result before its completion, in order."""
        seen = []
        while True:
            got = self.inbox.get(timeout=15)
            seen.append(got)
            if got.topic == COMPLETIONS and json.loads(got.payload)["job_id"] == job_id:
                return seen

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="module")
def mqtt() -> Iterator[ServerProcess]:
    with running(start_mosquitto()) as server:
        yield server


@pytest.fixture(scope="module")
def worker_redis(fresh_redis_db: Callable[[], str]) -> str:
    """This module's own database: its worker's audit stream holds only its records."""
    return fresh_redis_db()


@pytest.fixture(scope="module")
def worker(
    mqtt: ServerProcess, worker_redis: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceThread]:
    folder = tmp_path_factory.mktemp("returns")
    url = worker_redis
    settings = load_settings(
        mqtt={"port": mqtt.port, "plaintext": True},  # one role on a plain Mosquitto
        pool={
            "id": WORKER,
            "zone": WORKER_ZONE,
            "redis_url": url,
            "policy_file": write_policy_file(folder),
            "state_dir": folder / "state",
            "telemetry_interval_s": 0.2,
        },
    )
    watcher = PlainClient(mqtt.port)
    watcher.subscribe(topics.worker_status(WORKER))
    thread = ServiceThread(lambda stop: serve(settings, stop, connect_timeout=10)).start()
    while b'"online"' not in watcher.next(timeout=30).payload:
        pass
    watcher.close()
    yield thread
    thread.stop()


@pytest.fixture
def edge(mqtt: ServerProcess) -> Iterator[Edge]:
    made = Edge(mqtt.port, next(_next_edge))
    yield made
    made.close()


def _message(edge: Edge, spec: WorkSpec) -> Message:
    """``spec`` as ``edge`` sends it: on the worker's work topic under its own id."""
    return replace(spec, edge=edge.edge_id).message()


def test_the_result_returns_to_the_edge_with_job_attempt_worker_and_correlation(
    worker: ServiceThread, edge: Edge
) -> None:
    job = f"job-{uuid.uuid4().hex[:8]}"
    edge.send(_message(edge, WorkSpec(job_id=job, attempt="2", correlation=b"\x00app\xff")))
    seen = edge.until_completion(job)
    assert [g.topic for g in seen] == [topics.edge_returns(edge.edge_id, WORKER), COMPLETIONS]
    back, done = seen
    assert back.qos == 1
    assert back.correlation_data == b"\x00app\xff"
    assert back.user_properties == {
        topics.PROP_JOB_ID: job,
        topics.PROP_ATTEMPT: "2",
        topics.PROP_WORKER: WORKER,
    }
    result = json.loads(back.payload)
    assert (result["job_id"], result["status"]) == (job, "ok")
    assert result["outputs"]["label"] == TRUTH
    record = json.loads(done.payload)
    assert (record["attempt"], record["edge_id"], record["worker_id"]) == (2, edge.edge_id, WORKER)


def test_a_refusal_returns_to_the_edge_too(worker: ServiceThread, edge: Edge) -> None:
    job = f"job-{uuid.uuid4().hex[:8]}"
    edge.send(_message(edge, WorkSpec(job_id=job, token="", attempt="3")))
    back = edge.inbox.get(timeout=15)
    assert back.topic == topics.edge_returns(edge.edge_id, WORKER)
    assert back.user_properties[topics.PROP_ATTEMPT] == "3"
    result = json.loads(back.payload)
    assert (result["status"], result["code"]) == ("rejected", "token.missing")


def test_an_edge_the_policy_does_not_list_has_its_work_refused_unread(
    worker: ServiceThread, mqtt: ServerProcess
) -> None:
    stranger = Edge(mqtt.port, "unlisted-pc")
    try:
        job = f"job-{uuid.uuid4().hex[:8]}"
        stranger.send(_message(stranger, WorkSpec(job_id=job)))  # a valid token and all
        back = stranger.inbox.get(timeout=15)
    finally:
        stranger.close()
    assert back.topic == topics.edge_returns("unlisted-pc", WORKER)
    result = json.loads(back.payload)
    assert (result["job_id"], result["status"], result["code"]) == (
        job,
        "rejected",
        "edge.not_in_policy",
    )
    assert result["offload"]["placed"] is False


def test_work_on_a_topic_naming_no_edge_is_refused_before_decoding_and_audited(
    worker: ServiceThread, edge: Edge, worker_redis: str, mqtt: ServerProcess
) -> None:
    lost = f"lost-{uuid.uuid4().hex[:8]}"
    edge.send(WorkSpec(job_id=lost, edge="").message())  # .../work/ matches .../work/+
    # A job sent after it comes back; nothing came back, or went anywhere, for the first.
    after = f"job-{uuid.uuid4().hex[:8]}"
    edge.send(_message(edge, WorkSpec(job_id=after)))
    seen = edge.until_completion(after)
    assert [g.topic for g in seen] == [topics.edge_returns(edge.edge_id, WORKER), COMPLETIONS]
    assert json.loads(seen[0].payload)["job_id"] == after
    telemetry = PlainClient(mqtt.port)
    try:
        telemetry.subscribe(topics.worker_telemetry(WORKER))
        while "no_edge_id" not in json.loads(telemetry.next().payload)["refused"]:
            pass
    finally:
        telemetry.close()
    client = redis.Redis.from_url(worker_redis)
    try:
        entries = list(RedisStreamAuditStore(client, audit_stream_key(WORKER)).entries())
    finally:
        client.close()
    records = [decode_record(e) for e in entries]
    (refused,) = [r for r in records if r.data.get("job_id") == lost]
    assert refused.data["reason"] == "no_edge_id"
    assert "edge agent" in str(refused.data["message"])
    assert verify_chain(entries, {records[0].signer}).count == len(entries)
