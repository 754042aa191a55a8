"""Real tier: a broker replica against real Mosquitto and Redis, with workers played by plain
MQTT publishers of capabilities and telemetry (a worker is nothing more to the broker).

Checks placement within the policy, model requirements, sub-health, silent workers, the
Redis reservation, the job explanation over HTTP, metrics, OpenAPI and the audit chain, and
who is speaking: the requesting edge is the one whose topic carried the request, its origin
zone the policy's, and workers, completions and releases count only as the policy and their
topics say. The test Mosquitto is a plain one (no TLS, no ACL), so the campus is written
open (``secure=False``) and anything may be sent on any topic, as a forger would.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from broker import keys as broker_keys
from broker.run import serve
from policies import load_policy, verify, verify_chain
from policies.audit import decode_record
from policies.redis_stores import RedisStreamAuditStore, audit_stream_key
from policies.sealing import SealingKey, decode_seal_key, seal_key_id
from sluicegate import topics, wire
from sluicegate.app.broker_http import get_json, token_beside
from sluicegate.app.campus import Campus, write_campus
from sluicegate.app.servers import ServerProcess, free_port
from sluicegate.config import Settings, load_settings
from sluicegate.vision.runtime import default_models_dir
from sluicegate.wire_pool import (
    Completion,
    ModelCapability,
    PlacementRelease,
    PlacementReply,
    WorkerCapabilities,
    WorkerTelemetry,
)
from tests.policies.policy_testkit import key
from tests.support import PlainClient, ServiceThread, live_request, wait_until

pytestmark = pytest.mark.integration

FAB = "campus/fab-north"
WORKERS = {
    "north-a": (f"{FAB}/dc", "x86-cpu"),
    "north-b": (f"{FAB}/dc", "x86-cpu"),
    "north-gpu": (f"{FAB}/dc", "nvidia-l4"),
    "cloud-1": ("offsite/cloud-east", "x86-cpu"),
}
UNLISTED = (f"{FAB}/dc", "x86-cpu")  # where a worker the policy does not list says it is
DIGEST = "ab" * 32
EDGE = "line-1-pc"  # one of the campus's two edges, in f"{FAB}/line-1"


@pytest.fixture(scope="module")
def campus_redis(fresh_redis_db: Callable[[], str]) -> str:
    """The module campus's Redis database, its own."""
    return fresh_redis_db()


@pytest.fixture(scope="module")
def campus(
    tmp_path_factory: pytest.TempPathFactory, mosquitto: ServerProcess, campus_redis: str
) -> Campus:
    root = tmp_path_factory.mktemp("campus")
    redis_url = campus_redis
    made = write_campus(
        root, key, mqtt_port=mosquitto.port, redis_url=redis_url, workers=WORKERS, secure=False
    )
    # A second model that only a CUDA worker may run.
    models = root / "models"
    models.mkdir()
    manifest = json.loads((default_models_dir() / "defect-v1.json").read_text())
    shutil.copy(default_models_dir() / manifest["file"], models / manifest["file"])
    (models / "defect-v1.json").write_text(json.dumps(manifest))
    gpu_only = {
        **manifest,
        "name": "defect-gpu",
        "requirements": {"providers": ["CUDAExecutionProvider"], "memory_mb": 2048},
    }
    (models / "defect-gpu.json").write_text(json.dumps(gpu_only))
    return made


@pytest.fixture(scope="module")
def broker(campus: Campus) -> Iterator[tuple[ServiceThread, Settings]]:
    settings = load_settings(
        campus.node_config("broker-1"),
        broker={
            "http_port": free_port(),
            "models_dir": str(campus.root / "models"),
            "max_wait_ms": 5000.0,  # long enough for a test to watch a request wait
            # The workers played here never complete what is placed on them, which a real
            # one that has stalled does not either: the progress watch has tests of its own.
            "stall_floor_ms": 600_000.0,
        },
    )
    thread = serving(settings)
    yield thread, settings
    thread.stop()


def serving(settings: Settings) -> ServiceThread:
    """A broker replica on a thread, returned once it has announced itself online."""
    watcher = PlainClient(settings.mqtt.port)
    watcher.subscribe(topics.broker_status(settings.broker.id))
    thread = ServiceThread(lambda stop: serve(settings, stop, connect_timeout=10)).start()
    while b'"online"' not in watcher.next(timeout=20).payload:
        pass
    watcher.close()
    return thread


class Fleet:
    """Plays workers: publishes their capabilities and telemetry like real ones would."""

    def __init__(self, port: int, seal_keys: dict[str, str] | None = None) -> None:
        self.client = PlainClient(port)
        self.seal_keys = seal_keys or {}

    def capabilities(
        self,
        worker: str,
        *,
        providers: list[str],
        memory_mb: int = 16000,
        zone: str | None = None,
        on: str | None = None,
        seal_key: str | None = "",
    ) -> None:
        """``worker``'s capabilities (in ``zone``, by default its own), published on ``on``'s
        topic (by default its own), advertising ``seal_key`` (by default the sealing key the
        campus made for it; None: none)."""
        listed, device = WORKERS.get(worker, UNLISTED)
        zone = zone or listed
        caps = WorkerCapabilities(
            worker_id=worker,
            zone=zone,
            device_class=device,
            providers=providers,
            memory_total_mb=memory_mb,
            max_batch=8,
            concurrency=1,
            models={m: ModelCapability(version="1.0.0") for m in ("defect-v1", "defect-gpu")},
            seal_key=self.seal_keys.get(worker) if seal_key == "" else seal_key,
        )
        info = self.client.client.publish(
            topics.worker_capabilities(on or worker), wire.dump(caps), qos=1, retain=True
        )
        info.wait_for_publish(10)

    def telemetry(
        self,
        worker: str,
        *,
        queue: int = 0,
        util: float = 0.1,
        bandwidth: float = 0.1,
        capacity: int = 16,
    ) -> None:
        zone, device = WORKERS.get(worker, UNLISTED)
        tel = WorkerTelemetry(
            node=worker,
            zone=zone,
            ts=time.time(),
            device_class=device,
            utilisation=util,
            memory_used_mb=1000,
            memory_total_mb=16000,
            memory_bandwidth=bandwidth,
            queue_depth=queue,
            in_flight=0,
            capacity=capacity,
            models={},
            results={},
            refused={},
        )
        self.client.client.publish(topics.worker_telemetry(worker), wire.dump(tel), qos=1)


@pytest.fixture
def fleet(mosquitto: ServerProcess, campus: Campus) -> Iterator[Fleet]:
    f = Fleet(mosquitto.port, campus.seal_keys)
    yield f
    f.client.close()


def ask(
    mosquitto: ServerProcess,
    *,
    data_class: str = "wafer-image",
    model: str = "defect-v1",
    max_wait_ms: float = 0.0,
    edge: str = EDGE,
    named: str | None = None,
    origin: str = "",
    response_topic: str | None = None,
) -> PlacementReply:
    """Ask for a placement on ``edge``'s request topic, as a request naming edge ``named``
    (by default ``edge``) and declaring ``origin``, with ``response_topic`` as its MQTT
    Response Topic; the reply is read on ``edge``'s own reply topic."""
    client = PlainClient(mosquitto.port)
    client.subscribe(topics.placement_replies(edge))
    job_id = uuid.uuid4().hex
    req = live_request(
        named or edge,
        job_id,
        origin_zone=origin,
        model=model,
        data_class=data_class,
        payload_sha256=DIGEST,
        max_wait_ms=max_wait_ms,
    )
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if response_topic is not None:
        props.ResponseTopic = response_topic
    props.CorrelationData = job_id.encode()
    topic = topics.placement_request(edge)
    client.client.publish(topic, wire.dump(req), qos=1, properties=props)
    got = client.next(timeout=15)
    client.close()
    assert got.topic == topics.placement_replies(edge)
    assert got.correlation_data == job_id.encode()
    return PlacementReply.model_validate_json(got.payload)


def http(settings: Settings, path: str) -> tuple[int, Any]:
    """GET a broker view as the campus's console viewer."""
    url = f"http://127.0.0.1:{settings.broker.http_port}{path}"
    return get_json(url, token_beside(settings.console.users_file), timeout=10)


def test_placement_within_policy_explained_reserved_and_audited(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    campus: Campus,
    mosquitto: ServerProcess,
    campus_redis: str,
) -> None:
    _thread, settings = broker
    for worker in WORKERS:
        fleet.capabilities(worker, providers=["CPUExecutionProvider"])
        fleet.telemetry(worker)
    wait_until(lambda: len(http(settings, "/fleet")[1]["workers"]) == len(WORKERS))
    # Before any decision, each worker shows the zone the policy gives it.
    shown = {w["id"]: w["policy_zone"] for w in http(settings, "/fleet")[1]["workers"]}
    assert shown == {worker: zone for worker, (zone, _device) in WORKERS.items()}
    reply = ask(mosquitto)
    assert reply.status == "placed", reply
    assert reply.worker_id in ("north-a", "north-b", "north-gpu")
    assert reply.work_topic == topics.pool_work(f"{FAB}/dc", reply.worker_id, EDGE)
    policy = load_policy(campus.policy_file)
    claims = verify(
        reply.token or "",
        policy,
        now=time.time(),
        job_id=reply.job_id,
        payload_sha256=bytes.fromhex(DIGEST),
        worker_id=reply.worker_id,
    )
    assert claims.data_class == "wafer-image"
    assert claims.origin_zone == f"{FAB}/line-1"  # the edge's zone in the policy
    r = redis.Redis.from_url(campus_redis)
    assert r.zscore(broker_keys.reservations(reply.worker_id), reply.job_id) is not None
    # The decision's record is written right after the reply (the in-flight part before it).
    _status, job = wait_until(
        lambda: (s := http(settings, f"/jobs/{reply.job_id}"))[0] == 200 and "status" in s[1] and s
    )
    assert job["status"] == "placed"
    assert job["why"]["candidates"]["ranked"][0]["worker_id"] == reply.worker_id
    assert http(settings, "/jobs/nope")[0] == 404
    health_status, health = http(settings, "/health")
    assert health_status == 200
    assert health["ready"] is True
    assert health["checks"]["placements"] is True
    assert http(settings, "/policy")[1]["campus"] == "demo-campus"
    assert set(http(settings, "/openapi.json")[1]["paths"]) >= {"/fleet", "/jobs/{job_id}"}
    metrics = http(settings, "/metrics")[1]
    assert 'sluicegate_placement_decisions_total{outcome="placed"}' in metrics
    store = RedisStreamAuditStore(r, audit_stream_key("broker-1"))
    entries = wait_until(lambda: list(store.entries()))
    summary = verify_chain(entries, [key("broker-1").public])
    assert summary.count >= 1
    assert summary.signers == {key("broker-1").public}


def test_campus_only_class_never_goes_offsite_even_when_only_cloud_is_free(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    mosquitto: ServerProcess,
) -> None:
    for worker in ("north-a", "north-b", "north-gpu"):
        fleet.capabilities(worker, providers=["CPUExecutionProvider"])
        fleet.telemetry(worker, queue=16, capacity=16)  # full
    fleet.capabilities("cloud-1", providers=["CPUExecutionProvider"])
    fleet.telemetry("cloud-1")
    _thread, settings = broker
    wait_until(
        lambda: all(
            w["load"]["queue_depth"] == 16
            for w in http(settings, "/fleet")[1]["workers"]
            if w["id"].startswith("north")
        )
    )
    wafer = ask(mosquitto, data_class="wafer-image")
    assert wafer.status == "refused"
    assert wafer.code == "no_capacity"
    ocr = ask(mosquitto, data_class="ocr-crop")
    assert ocr.status == "placed"
    assert ocr.worker_id == "cloud-1"


def test_a_confidential_job_goes_only_where_it_can_be_sealed_and_binds_that_key(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    campus: Campus,
    mosquitto: ServerProcess,
) -> None:
    _thread, settings = broker
    stray = SealingKey.generate().public_text  # a key the policy does not list
    for worker, advertised in (("north-a", ""), ("north-b", None), ("north-gpu", stray)):
        fleet.capabilities(worker, providers=["CPUExecutionProvider"], seal_key=advertised)
        fleet.telemetry(worker)
    fleet.capabilities("cloud-1", providers=["CPUExecutionProvider"])
    fleet.telemetry("cloud-1")
    _ready(settings, lambda ws: all(ws.get(w, {}).get("online") for w in WORKERS))
    policy = load_policy(campus.policy_file)
    north_a = seal_key_id(decode_seal_key(campus.seal_keys["north-a"]))
    for _ in range(4):  # only north-a can be sealed to: placement passes the others by
        reply = ask(mosquitto, data_class="wafer-image")
        assert reply.status == "placed", reply
        assert reply.worker_id == "north-a"
        claims = verify(
            reply.token or "",
            policy,
            now=time.time(),
            job_id=reply.job_id,
            payload_sha256=None,
            worker_id="north-a",
        )
        assert claims.seal_key_id == north_a
    ocr = ask(mosquitto, data_class="ocr-crop")  # not confidential: in the clear, anywhere
    assert ocr.status == "placed", ocr
    clear = verify(ocr.token or "", policy, now=time.time(), job_id=ocr.job_id, payload_sha256=None)
    assert not clear.sealed
    fleet.capabilities("north-a", providers=["CPUExecutionProvider"], seal_key=None)
    refused = wait_until(
        lambda: (r := ask(mosquitto, data_class="wafer-image")).code == "seal_unavailable" and r
    )
    assert refused.status == "refused"
    assert "confidential" in (refused.reason or "")


def _ready(settings: Settings, check: Any) -> None:
    wait_until(lambda: check({w["id"]: w for w in http(settings, "/fleet")[1]["workers"]}))


def test_model_needing_a_provider_or_memory_goes_only_where_it_fits(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    mosquitto: ServerProcess,
) -> None:
    _thread, settings = broker
    fleet.capabilities("north-a", providers=["CPUExecutionProvider"])
    fleet.capabilities("north-b", providers=["CUDAExecutionProvider"], memory_mb=1024)
    fleet.capabilities("north-gpu", providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    fleet.capabilities("cloud-1", providers=["CUDAExecutionProvider"])
    for worker in WORKERS:
        fleet.telemetry(worker)
    _ready(
        settings,
        lambda ws: (
            "CUDAExecutionProvider" in ws["north-b"]["capabilities"]["providers"]
            and ws["north-b"]["load"]["queue_depth"] == 0
        ),
    )
    for _ in range(5):
        reply = ask(mosquitto, model="defect-gpu")
        assert reply.status == "placed"
        # north-a lacks CUDA; north-b has it but 1 GiB is less than the 2 GiB the model
        # needs; cloud-1 is off-site for a wafer image.
        assert reply.worker_id == "north-gpu"


def test_subhealthy_worker_gets_nothing_while_a_healthy_one_has_room(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    mosquitto: ServerProcess,
) -> None:
    _thread, settings = broker
    for worker in WORKERS:
        fleet.capabilities(worker, providers=["CPUExecutionProvider"])
    fleet.telemetry("north-a", util=0.8, bandwidth=0.95)  # memory-bound: sub-healthy
    fleet.telemetry("north-b", queue=10)  # healthy but busier
    fleet.telemetry("north-gpu", queue=16, capacity=16)  # full
    fleet.telemetry("cloud-1")
    _ready(
        settings,
        lambda ws: (
            ws["north-a"]["health"]["subhealthy"] and ws["north-b"]["load"]["queue_depth"] == 10
        ),
    )
    placed = [ask(mosquitto).worker_id for _ in range(4)]
    assert placed == ["north-b"] * 4
    fleet.telemetry("north-b", queue=16, capacity=16)  # now the healthy one is full too
    _ready(settings, lambda ws: ws["north-b"]["load"]["queue_depth"] == 16)
    assert ask(mosquitto).worker_id == "north-a"  # sub-healthy, but the only one with room


def test_silent_worker_stops_getting_placements(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    mosquitto: ServerProcess,
) -> None:
    _thread, settings = broker
    for worker in WORKERS:
        fleet.capabilities(worker, providers=["CPUExecutionProvider"])
    for worker in ("north-b", "north-gpu"):
        fleet.telemetry(worker, queue=16, capacity=16)
    fleet.telemetry("north-a")
    _ready(settings, lambda ws: ws["north-b"]["load"]["queue_depth"] == 16)
    assert ask(mosquitto).worker_id == "north-a"
    silent_since = time.monotonic()

    def north_a_gone() -> bool:
        # The others keep reporting (as live workers do); north-a has gone silent.
        fleet.telemetry("north-b", queue=16, capacity=16)
        fleet.telemetry("north-gpu", queue=16, capacity=16)
        workers = {w["id"]: w for w in http(settings, "/fleet")[1]["workers"]}
        return not workers["north-a"]["online"]

    wait_until(north_a_gone, timeout=15)
    gone_after = time.monotonic() - silent_since
    reply = ask(mosquitto)
    assert reply.status == "refused"
    assert reply.worker_id is None
    # 3 telemetry intervals of 1 s, plus the housekeeping tick that notices.
    assert gone_after < 3 * settings.broker.telemetry_interval_s + 2.0


def test_request_waits_for_room_and_is_placed_when_a_worker_frees_up(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    mosquitto: ServerProcess,
) -> None:
    _thread, settings = broker
    for worker in WORKERS:
        fleet.capabilities(worker, providers=["CPUExecutionProvider"])
        fleet.telemetry(worker, queue=16, capacity=16)  # everyone full
    _ready(
        settings, lambda ws: all((w["load"] or {}).get("queue_depth") == 16 for w in ws.values())
    )
    replies: list[PlacementReply] = []
    asking = threading.Thread(target=lambda: replies.append(ask(mosquitto, max_wait_ms=3000)))
    asking.start()
    # The request is held, not refused: wait until the broker reports it waiting.
    wait_until(lambda: "sluicegate_placement_waiting 1.0" in http(settings, "/metrics")[1])
    fleet.telemetry("north-b", queue=3, capacity=16)  # room frees up on one campus worker
    asking.join(15)
    assert replies
    assert replies[0].status == "placed", replies[0]
    assert replies[0].worker_id == "north-b"


def test_a_placement_handed_back_unused_frees_its_slot_at_once(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    mosquitto: ServerProcess,
    campus_redis: str,
) -> None:
    _thread, settings = broker
    for worker in WORKERS:
        fleet.capabilities(worker, providers=["CPUExecutionProvider"])
        fleet.telemetry(worker, queue=14 if worker == "north-b" else 16, capacity=16)
    _ready(
        settings,
        lambda ws: all(
            (w["load"] or {}).get("queue_depth") == (14 if name == "north-b" else 16)
            for name, w in ws.items()
        ),
    )
    # Fill north-b (a reservation an earlier test left here may hold one of its slots).
    placed = []
    while (reply := ask(mosquitto)).status == "placed" and len(placed) < 3:
        placed.append(reply)
    assert reply.code == "no_capacity", reply
    assert placed
    assert {p.worker_id for p in placed} == {"north-b"}
    first = placed[-1]
    r = redis.Redis.from_url(campus_redis)
    slots = broker_keys.reservations("north-b")
    assert r.zscore(slots, first.job_id) is not None
    edge = PlainClient(mosquitto.port)

    def hand_back(payload: bytes) -> None:
        topic = topics.placement_release("line-1-pc")
        edge.client.publish(topic, payload, qos=1).wait_for_publish(10)

    release = PlacementRelease(
        job_id=first.job_id,
        edge_id="line-1-pc",
        worker_id="north-b",
        attempt=1,
        reason="placed after the edge stopped waiting (50 ms)",
    )
    # Not JSON, another edge's (sent on this edge's topic: refused by name), an older
    # attempt's, another worker's: none is this placement, so none releases it (the record
    # below names the one that did).
    refused_before = _identity_refusals(settings, "release.id_mismatch")
    hand_back(b"{not json")
    for wrong in ({"edge_id": "line-2-pc"}, {"attempt": 2}, {"worker_id": "north-a"}):
        hand_back(wire.dump(release.model_copy(update=wrong)))
    hand_back(wire.dump(release))
    hand_back(wire.dump(release))  # heard again, as every replica hears it: released once
    wait_until(lambda: r.zscore(slots, first.job_id) is None)
    _status, job = wait_until(
        lambda: (s := http(settings, f"/jobs/{first.job_id}"))[1].get("status") == "released" and s
    )
    assert job["released"] == {
        **release.model_dump(exclude={"v", "edge_id", "worker_id"}),
        "status": "released",
        "edge": "line-1-pc",
        "worker": "north-b",
    }
    assert job["inflight"]["released_attempt"] == 1  # the record stays, marked
    assert job["inflight"]["released_at"] is not None
    metrics = http(settings, "/metrics")[1]
    assert "sluicegate_placements_released_total 1.0" in metrics
    assert _identity_refusals(settings, "release.id_mismatch") == refused_before + 1
    again = ask(mosquitto)  # the broker kept serving, and the slot is free again
    assert (again.status, again.worker_id) == ("placed", "north-b")
    edge.close()


def _identity_refusals(settings: Settings, code: str) -> float:
    """``sluicegate_identity_refusals_total{code}`` as the broker reports it (0 before any)."""
    text = http(settings, "/metrics")[1]
    pattern = rf'^sluicegate_identity_refusals_total\{{code="{re.escape(code)}"\}} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _everyone_free(settings: Settings, fleet: Fleet) -> None:
    for worker in WORKERS:
        fleet.capabilities(worker, providers=["CPUExecutionProvider"])
        fleet.telemetry(worker)
    _ready(
        settings,
        lambda ws: all(
            name in ws and (ws[name]["load"] or {}).get("queue_depth") == 0 for name in WORKERS
        ),
    )


def test_a_request_on_one_edges_topic_naming_another_is_refused_and_answered_to_the_sender(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    mosquitto: ServerProcess,
) -> None:
    _thread, settings = broker
    _everyone_free(settings, fleet)
    before = _identity_refusals(settings, "edge.id_mismatch")
    named = PlainClient(mosquitto.port)  # what line-2-pc hears
    try:
        named.subscribe(topics.placement_replies("line-2-pc"))
        # line-1-pc asks as line-2-pc, and names line-2-pc's reply topic as Response Topic.
        forged = ask(
            mosquitto,
            edge="line-1-pc",
            named="line-2-pc",
            response_topic=topics.placement_replies("line-2-pc"),
        )
        assert (forged.status, forged.code) == ("refused", "edge.id_mismatch")
        assert (forged.token, forged.worker_id) == (None, None)
        assert "'line-2-pc'" in (forged.reason or "")
        assert "'line-1-pc'" in (forged.reason or "")
        assert _identity_refusals(settings, "edge.id_mismatch") == before + 1
        # line-2-pc's own request is answered to it; the forged one's answer never was.
        own = ask(mosquitto, edge="line-2-pc")
        assert own.status == "placed", own
        first = PlacementReply.model_validate_json(named.next().payload)
        assert first.job_id == own.job_id
    finally:
        named.close()


def test_an_edge_the_policy_does_not_list_gets_no_placement(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    mosquitto: ServerProcess,
) -> None:
    _thread, settings = broker
    _everyone_free(settings, fleet)
    before = _identity_refusals(settings, "edge.not_in_policy")
    stranger = ask(mosquitto, edge="line-9-pc", origin=f"{FAB}/line-1")
    assert (stranger.status, stranger.code) == ("refused", "edge.not_in_policy")
    assert stranger.token is None
    assert "'line-9-pc'" in (stranger.reason or "")
    assert _identity_refusals(settings, "edge.not_in_policy") == before + 1
    assert ask(mosquitto).status == "placed"  # a listed edge, asking just the same


def test_the_origin_zone_is_the_edges_in_the_policy_whatever_the_request_declares(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    mosquitto: ServerProcess,
    campus: Campus,
) -> None:
    _thread, settings = broker
    _everyone_free(settings, fleet)
    reply = ask(mosquitto, edge="line-2-pc", origin="offsite/cloud-east")
    assert reply.status == "placed", reply
    assert reply.work_topic == topics.pool_work(f"{FAB}/dc", reply.worker_id or "", "line-2-pc")
    claims = verify(
        reply.token or "",
        load_policy(campus.policy_file),
        now=time.time(),
        job_id=reply.job_id,
        payload_sha256=bytes.fromhex(DIGEST),
        worker_id=reply.worker_id,
    )
    assert claims.origin_zone == f"{FAB}/line-2"


def test_workers_count_only_as_the_policy_and_their_topics_say_and_are_audited_once(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,
    mosquitto: ServerProcess,
    campus_redis: str,
) -> None:
    _thread, settings = broker
    _everyone_free(settings, fleet)
    codes = (
        "worker.not_in_policy",
        "worker.zone_mismatch",
        "worker.id_mismatch",
        "completion.id_mismatch",
    )
    before = {code: _identity_refusals(settings, code) for code in codes}
    cpu = ["CPUExecutionProvider"]
    fleet.capabilities("ghost-gpu", providers=cpu)  # a worker the policy does not list ...
    fleet.capabilities("ghost-gpu", providers=cpu)  # ... again ...
    fleet.telemetry("ghost-gpu")  # ... and reporting: counted each time, audited once
    fleet.capabilities("cloud-1", providers=cpu, zone=f"{FAB}/dc")  # not its zone
    fleet.capabilities("north-b", providers=cpu, memory_mb=1, on="north-gpu")  # not its topic
    done = Completion(
        job_id="not-mine",
        worker_id="north-b",
        status="ok",
        model="defect-v1",
        service_ms=5.0,
        queue_ms=0.0,
        batch_size=1,
        ts=time.time(),
    )
    info = fleet.client.client.publish(topics.completion("north-a"), wire.dump(done), qos=1)
    info.wait_for_publish(10)
    wanted = {
        "worker.not_in_policy": 3,
        "worker.zone_mismatch": 1,
        "worker.id_mismatch": 1,
        "completion.id_mismatch": 1,
    }
    wait_until(
        lambda: all(
            _identity_refusals(settings, code) == before[code] + n for code, n in wanted.items()
        )
    )
    workers = {w["id"]: w for w in http(settings, "/fleet")[1]["workers"]}
    assert "ghost-gpu" not in workers
    assert workers["cloud-1"]["zone"] == "offsite/cloud-east"
    assert workers["north-b"]["capabilities"]["memory_total_mb"] == 16000
    r = redis.Redis.from_url(campus_redis)
    store = RedisStreamAuditStore(r, audit_stream_key("broker-1"))

    def refused_ghost() -> list[dict[str, Any]]:
        found = []
        for entry in store.entries():
            record = decode_record(entry)
            if record.kind == "identity.refused":
                decisions = json.loads(str(record.data["decisions"]))
                found += [d for d in decisions if d["node"] == "ghost-gpu"]
        return found

    (audited,) = wait_until(refused_ghost)
    assert (audited["kind"], audited["code"]) == ("worker", "worker.not_in_policy")
    assert "'ghost-gpu'" in audited["reason"]
    fleet.capabilities("cloud-1", providers=cpu)  # leave its retained document its own


def test_the_edges_finished_jobs_and_the_offload_ratio_follow_their_telemetry(
    broker: tuple[ServiceThread, Settings], mosquitto: ServerProcess
) -> None:
    _, settings = broker
    tel = wire.EdgeTelemetry(
        node=EDGE,
        zone=f"{FAB}/line-1",
        ts=time.time(),
        queue_depth=5,
        queue_capacity=64,
        in_flight=0,
        concurrency=1,
        models={},
        cpu_percent=5.0,
        memory_rss_mb=100.0,
        memory_percent=1.0,
        results={"ok": 42, "rejected": 3},  # every answer, offloaded ones included
        dropped_no_response_topic=0,
        offloaded=8,  # attempts sent, a retry among them
        finished={"edge": 35, "pool": 7},
    )
    client = PlainClient(mosquitto.port)
    client.client.publish(topics.edge_telemetry(EDGE), wire.dump(tel), qos=1).wait_for_publish(10)
    client.close()
    zone = f"{FAB}/line-1"  # the edge's zone in the policy: the series are by zone
    here = f'sluicegate_edge_finished_jobs{{ran_on="edge",zone="{zone}"}} 35.0'

    def reported() -> str | None:
        text: str = http(settings, "/metrics")[1]
        return text if here in text else None

    text = wait_until(reported)
    assert f'sluicegate_edge_finished_jobs{{ran_on="pool",zone="{zone}"}} 7.0' in text
    assert f'sluicegate_edge_queued_jobs{{zone="{zone}"}} {float(tel.queue_depth)}' in text
    assert f'edge="{EDGE}"' not in text  # no series per edge: each edge has its own
    ratio = re.search(r"^sluicegate_offload_ratio (\S+)$", text, re.MULTILINE)
    assert ratio is not None
    assert float(ratio.group(1)) == pytest.approx(7 / 42)


def _edge_telemetry(node: str, queue_depth: int) -> bytes:
    return wire.dump(
        wire.EdgeTelemetry(
            node=node,
            zone="declared/by/the/node",  # the fleet shows the policy's zone beside it
            ts=time.time(),
            queue_depth=queue_depth,
            queue_capacity=64,
            in_flight=0,
            concurrency=1,
            models={},
            cpu_percent=5.0,
            memory_rss_mb=100.0,
            memory_percent=1.0,
            results={},
            dropped_no_response_topic=0,
        )
    )


def _telemetry_counted(settings: Settings) -> dict[str, float]:
    metrics: str = http(settings, "/metrics")[1]
    pattern = r'^sluicegate_broker_telemetry_total\{outcome="(\w+)"\} (\S+)$'
    return {k: float(v) for k, v in re.findall(pattern, metrics, re.MULTILINE)}


def test_the_fleet_shows_the_policys_edges_in_pages_and_counts_what_it_ignored(
    broker: tuple[ServiceThread, Settings], mosquitto: ServerProcess
) -> None:
    _, settings = broker
    client = PlainClient(mosquitto.port)
    before = _telemetry_counted(settings)

    def send(node: str, payload: bytes) -> None:
        client.client.publish(topics.edge_telemetry(node), payload, qos=1).wait_for_publish(10)

    def counted(outcome: str, more: float) -> bool:
        return _telemetry_counted(settings).get(outcome, 0.0) >= before.get(outcome, 0.0) + more

    # One at a time: a node's next sample would replace an unread one (coalesced).
    send("ghost-pc", _edge_telemetry("ghost-pc", 1))  # a node the policy does not list
    wait_until(lambda: counted("ignored", 1))
    send("line-2-pc", b"{not json")
    wait_until(lambda: counted("malformed", 1))
    send("line-2-pc", _edge_telemetry(EDGE, 99))  # on line-2-pc's topic, about line-1-pc
    wait_until(lambda: counted("ignored", 2))
    send(EDGE, _edge_telemetry(EDGE, 3))
    send("line-2-pc", _edge_telemetry("line-2-pc", 4))
    client.close()

    def shown() -> dict[str, Any] | None:
        fleet: dict[str, Any] = http(settings, "/fleet")[1]
        depths = {e["node"]: e["queue_depth"] for e in fleet["edges"]}
        return fleet if depths == {EDGE: 3, "line-2-pc": 4} else None

    fleet = wait_until(shown)
    assert {e["node"]: e["policy_zone"] for e in fleet["edges"]} == {
        EDGE: f"{FAB}/line-1",
        "line-2-pc": f"{FAB}/line-2",
    }
    assert fleet["page"] == {"limit": 1000, "edges": 2, "next_after": None}

    first = http(settings, "/fleet?limit=1")[1]
    assert [e["node"] for e in first["edges"]] == [EDGE]
    assert first["page"] == {"limit": 1, "edges": 2, "next_after": EDGE}
    second = http(settings, f"/fleet?limit=1&after={EDGE}")[1]
    assert [e["node"] for e in second["edges"]] == ["line-2-pc"]
    assert second["page"]["next_after"] is None
    zoned = http(settings, f"/fleet?zone={FAB}/line-2")[1]
    assert [e["node"] for e in zoned["edges"]] == ["line-2-pc"]
    assert all(w["zone"].startswith(f"{FAB}/line-2") for w in zoned["workers"])
    status, body = http(settings, "/fleet?limit=0")
    assert status == 400
    assert "limit" in body["error"]
