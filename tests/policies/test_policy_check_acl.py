"""Policy lint findings, and Mosquitto ACLs proven against a real Mosquitto."""

from __future__ import annotations

import queue
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from policy_testkit import EXAMPLE, EXAMPLE_KEY_NAMES, base_doc, key, policy_of

from policies.acl import V1, TopicTemplates, reachable_zones, render_acl
from policies.check import PUBLISHED_TEST_KEYS, check_policy
from policies.loader import load_policy
from sluicegate.servers import ServerProcess, running, start_mosquitto

POLICY = load_policy(EXAMPLE)


def _codes(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    findings = check_policy(policy_of(doc))
    return [(f.severity, f.code, f.key) for f in findings if f.code != "test-key"]


def test_every_published_test_key_is_flagged() -> None:
    assert {key(name).public_text for name in EXAMPLE_KEY_NAMES} == PUBLISHED_TEST_KEYS
    findings = check_policy(POLICY)
    assert {f.code for f in findings} == {"test-key"}
    assert len(findings) == len(EXAMPLE_KEY_NAMES)


def test_clean_policy_has_no_findings() -> None:
    assert _codes(base_doc()) == []


def test_unknown_zones_are_errors() -> None:
    doc = base_doc()
    doc["pools"]["west"] = {"zone": "campus/fab-west/dc", "workers": ["west-1"]}
    doc["edges"]["west-pc"] = {"zone": "campus/fab-west/l1", "key": key("broker-2").public_text}
    doc["classes"]["ocr-crop"]["deny"] = ["offsite/cloud-west", "campus/fab-west/** -> campus/**"]
    assert _codes(doc) == [
        ("error", "unknown-zone", "pools.west.zone"),
        ("error", "unknown-zone", "edges.west-pc.zone"),
        ("error", "unknown-zone", "classes.ocr-crop.deny[0]"),
        ("error", "unknown-zone", "classes.ocr-crop.deny[1]"),
    ]


def test_shadowed_redundant_and_unprocessable() -> None:
    doc = base_doc()
    doc["classes"]["wafer-image"]["allow"] = ["campus/**", "campus/fab-north/dc"]
    doc["classes"]["sealed"] = {"allow": ["campus/fab-north/dc"], "deny": ["campus/**"]}
    codes = _codes(doc)
    assert ("warning", "redundant", "classes.wafer-image.allow[1]") in codes
    assert ("warning", "shadowed", "classes.sealed.allow[0]") in codes
    assert ("warning", "unprocessable-class", "classes.sealed") in codes
    assert not any(code[2] == "classes.wafer-image" for code in codes)


def test_key_reuse_and_id_collisions() -> None:
    doc = base_doc()
    doc["policy_signers"]["keys"]["alice-again"] = key("officer-alice").public_text
    doc["broker_signers"]["keys"]["north-gpu-1"] = key("officer-bob").public_text
    doc["edges"]["south-npu-1"] = {"zone": "campus/fab-south/dc", "key": key("mallory").public_text}
    codes = _codes(doc)
    assert ("error", "shared-key", "broker_signers.keys.north-gpu-1") in codes
    assert ("error", "id-collision", "broker_signers.keys.north-gpu-1") in codes
    assert ("error", "id-collision", "edges.south-npu-1") in codes
    assert ("warning", "duplicate-key", "policy_signers.keys.alice-again") in codes
    assert codes.index(("warning", "duplicate-key", "policy_signers.keys.alice-again")) > max(
        i for i, c in enumerate(codes) if c[0] == "error"
    )


def test_acl_scopes_workers_to_their_own_work_topic() -> None:
    text = render_acl(POLICY)
    block = text.split("user north-gpu-1\n")[1].split("\n\n")[0].splitlines()
    reads = [line for line in block if line.startswith("topic read")]
    assert reads == [
        "topic read sluicegate/v1/pool/campus/fab-north/dc/north-gpu-1/work",
        "topic read sluicegate/v1/policy",
    ]
    assert "#" not in text.split("user cloud-gpu-1\n")[1].split("\n\n")[0]
    assert text == render_acl(POLICY)  # deterministic


def test_acl_lets_an_edge_write_only_where_some_class_may_go() -> None:
    doc = base_doc()
    doc["classes"] = {"wafer-image": {"allow": ["campus/fab-north/**"]}}
    doc["edges"]["lost-pc"] = {"zone": "campus/fab-west/l1", "key": key("broker-2").public_text}
    policy = policy_of(doc)
    assert reachable_zones(policy, "campus/fab-north/line-1") == [
        "campus/fab-north/dc",
        "campus/fab-north/line-1",
    ]
    text = render_acl(policy, TopicTemplates(results="results/+"))
    edge = text.split("user north-l1-pc\n")[1].split("\n\n")[0]
    assert "topic write sluicegate/v1/pool/campus/fab-north/dc/north-gpu-1/work" in edge
    assert "south-npu-1/work" not in edge
    assert "cloud-gpu-1/work" not in edge
    assert "topic write results/+" in edge
    lost = text.split("user lost-pc\n")[1].split("\n\n")[0]
    assert "/work" not in lost
    broker = text.split("user broker-1\n")[1]
    assert "topic read sluicegate/v1/broker/placement/request" in broker
    assert "topic write sluicegate/v1/policy" in broker
    assert "topic write sluicegate/v1/edge/north-l1-pc/placement" in broker
    assert "topic read sluicegate/v1/worker/north-gpu-1/telemetry" in broker
    assert "topic read sluicegate/v1/broker/completions" in broker
    assert "/pool/" not in broker  # the broker never reads a work topic: no images
    assert "topic write sluicegate/v1/edge/north-l1-pc/notices" in broker
    assert "topic write sluicegate/v1/edge/lost-pc/notices" in broker
    worker = text.split("user north-gpu-1\n")[1].split("\n\n")[0]
    assert "topic read sluicegate/v1/pool/campus/fab-north/dc/north-gpu-1/work" in worker
    assert "topic write sluicegate/v1/broker/completions" in worker
    assert "topic write sluicegate/v1/worker/north-gpu-1/capabilities" in worker
    # Results go back only to the edges that may place work here, never to an app topic.
    assert "topic write sluicegate/v1/edge/north-l1-pc/returns" in worker
    assert "lost-pc" not in worker
    assert "results" not in worker
    south = text.split("user south-npu-1\n")[1].split("\n\n")[0]
    assert "/returns" not in south  # no edge's data may go to its zone


class _Client:
    """A paho MQTT v5 client logged in as one node id (the ACL user)."""

    def __init__(self, server: ServerProcess, user: str) -> None:
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.subacks: queue.Queue[list[ReasonCode]] = queue.Queue()
        connected = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"acl-{user}", protocol=mqtt.MQTTv5
        )
        self.client.username_pw_set(user)
        self.client.on_connect = lambda *_: connected.set()
        self.client.on_message = lambda _c, _u, m: self.messages.put((m.topic, m.payload))
        self.client.on_subscribe = lambda _c, _u, _m, codes, _p: self.subacks.put(codes)
        self.client.connect(server.host, server.port)
        self.client.loop_start()
        assert connected.wait(5)

    def subscribe(self, topic: str) -> None:
        self.client.subscribe(topic, qos=1)
        self.subacks.get(timeout=5)

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1, properties=Properties(3)).wait_for_publish(5)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def acl_mosquitto() -> Iterator[ServerProcess]:
    # Mosquitto started as root drops to its own user, which must be able to read the ACL.
    workdir = Path(tempfile.mkdtemp(prefix="sg-acl-"))
    workdir.chmod(0o755)
    with running(start_mosquitto(workdir=workdir)) as server:
        (workdir / "acl").write_text(render_acl(POLICY))
        conf = workdir / "mosquitto.conf"
        conf.write_text(conf.read_text() + f"acl_file {workdir / 'acl'}\n")
        server.restart()
        yield server


@pytest.mark.integration
def test_real_mosquitto_enforces_the_generated_acl(acl_mosquitto: ServerProcess) -> None:
    worker = _Client(acl_mosquitto, "north-gpu-1")
    edge = _Client(acl_mosquitto, "north-l1-pc")
    broker = _Client(acl_mosquitto, "broker-1")
    try:
        own = V1.worker_work.format(zone="campus/fab-north/dc", worker_id="north-gpu-1")
        other = V1.worker_work.format(zone="campus/fab-south/dc", worker_id="south-npu-1")
        # Mosquitto 2.0 grants any subscription and enforces 'read' when it delivers.
        for topic in (own, other, "sluicegate/v1/pool/#"):
            worker.subscribe(topic)
        broker.subscribe("sluicegate/v1/edge/+/telemetry")
        # The edge may not publish on another edge's topic; its own arrives.
        edge.publish(V1.edge_telemetry.format(edge_id="south-l1-pc"), b"forged")
        edge.publish(V1.edge_telemetry.format(edge_id="north-l1-pc"), b"mine")
        assert broker.messages.get(timeout=5) == (
            "sluicegate/v1/edge/north-l1-pc/telemetry",
            b"mine",
        )
        # A worker receives nothing from another worker's work topic, only from its own.
        edge.publish(other, b"south image")
        edge.publish(own, b"north image")
        received = [worker.messages.get(timeout=5)]
        received += [worker.messages.get(timeout=5)]  # once for each matching subscription
        assert received == [(own, b"north image")] * 2
        # The worker returns results to the edge, the broker sends it notices; nobody else
        # may write to that edge's topics.
        returns = V1.edge_returns.format(edge_id="north-l1-pc")
        notices = V1.edge_notices.format(edge_id="north-l1-pc")
        edge.subscribe(returns)
        edge.subscribe(notices)
        edge.publish(returns, b"forged by the edge itself")
        broker.publish(returns, b"forged by the broker")
        worker.publish(notices, b"forged by a worker")
        worker.publish(returns, b"result")
        broker.publish(notices, b"notice")
        got = {edge.messages.get(timeout=5), edge.messages.get(timeout=5)}
        assert got == {(returns, b"result"), (notices, b"notice")}
        assert edge.messages.empty()
        assert worker.messages.empty()
        assert broker.messages.empty()
    finally:
        for client in (worker, edge, broker):
            client.close()
