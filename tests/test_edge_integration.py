"""Real tier: an edge agent with the real MQTT transport and ONNX Runtime, against a real
Mosquitto, driven by a plain paho-mqtt v5 client that knows nothing of Sluicegate's code.

The test Mosquitto is a plain one, so the agent runs with ``[mqtt] plaintext``, starting
from an installed signed policy (no campus broker is online: it serves everything here).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sluicegate import topics
from sluicegate.app.servers import ServerProcess
from sluicegate.config import load_settings
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from sluicegate.vision.synth import LABELS, encode_jpeg, encode_png, generate
from tests.image_bytes import corrupt_jpeg, jpeg_header_only, png_header_only, sample_jpeg
from tests.support import AgentThread, PlainClient, installed_policy

pytestmark = pytest.mark.integration

LIMIT = 1 << 20  # the agent under test accepts payloads up to 1 MiB


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry.from_dir(default_models_dir())


@pytest.fixture(scope="module")
def edge(mosquitto: ServerProcess, registry: ModelRegistry) -> Iterator[AgentThread]:
    settings = load_settings(
        mqtt={"port": mosquitto.port, "plaintext": True},
        offload={"policy_file": installed_policy()},
        edge={
            "id": f"edge-{uuid.uuid4().hex[:8]}",
            "zone": "campus/test/line-1",
            "telemetry_interval_s": 0.2,
            "max_payload_bytes": LIMIT,
            "queue_size": 512,
        },
    )
    watcher = PlainClient(mosquitto.port)
    agent = AgentThread(settings, registry)
    agent.start(watcher)
    watcher.close()
    yield agent
    agent.stop()


@pytest.fixture
def app(mosquitto: ServerProcess, unique: str) -> Iterator[tuple[PlainClient, str]]:
    client = PlainClient(mosquitto.port)
    response_topic = f"tests/{unique}/results"
    client.subscribe(response_topic)
    yield client, response_topic
    client.close()


def ask(
    app: tuple[PlainClient, str],
    edge: AgentThread,
    payload: bytes,
    *,
    content_type: str | None = "image/jpeg",
    **props: str,
) -> dict[str, Any]:
    client, response_topic = app
    corr = uuid.uuid4().bytes
    user = {topics.PROP_MODEL: "defect-v1", **{k.replace("_", "-"): v for k, v in props.items()}}
    client.submit(
        edge.settings.edge.id,
        payload,
        response_topic=response_topic,
        correlation=corr,
        content_type=content_type,
        user=list(user.items()),
    )
    got = client.next()
    assert got.correlation_data == corr
    assert got.content_type == "application/json"
    result: dict[str, Any] = json.loads(got.payload)
    return result


def test_plain_paho_job_gets_right_labels(app: tuple[PlainClient, str], edge: AgentThread) -> None:
    rng = np.random.default_rng(424242)
    right = 0
    n = 80
    for i in range(n):
        img, truth = generate(rng, LABELS[i % len(LABELS)])
        data = encode_png(img) if i % 10 == 0 else encode_jpeg(img)
        result = ask(app, edge, data, content_type=None if i % 10 == 0 else "image/jpeg")
        assert result["status"] == "ok", result
        assert result["ran_on"] == {
            "kind": "edge",
            "node": edge.settings.edge.id,
            "zone": "campus/test/line-1",
        }
        assert set(result["outputs"]["scores"]) == set(LABELS)
        assert result["timings_ms"]["inference_ms"] > 0
        assert result["timings_ms"]["total_ms"] >= result["timings_ms"]["inference_ms"]
        t = result["timings_ms"]  # run here: the whole run is the job's device time
        parts = t["decode_ms"] + t["preprocess_ms"] + t["inference_ms"]
        assert t["device_ms"] == pytest.approx(parts, abs=0.002)
        right += result["outputs"]["label"] == truth
    assert right / n >= 0.95, f"{right}/{n} labels right"


def test_200_jobs_from_4_clients_each_answered_exactly_once(
    mosquitto: ServerProcess, edge: AgentThread, unique: str
) -> None:
    images = [sample_jpeg(seed)[0] for seed in range(8)]
    failures: list[str] = []

    def one_client(k: int) -> None:
        client = PlainClient(mosquitto.port)
        topic = f"tests/{unique}/c{k}"
        client.subscribe(topic)
        sent = {f"{k}-{i}".encode() for i in range(50)}
        for i, corr in enumerate(sorted(sent)):
            client.submit(
                edge.settings.edge.id,
                images[i % 8],
                response_topic=topic,
                correlation=corr,
                user=[("model", "defect-v1")],
            )
        seen: Counter[bytes] = Counter()
        while sum(seen.values()) < len(sent):
            got = client.next(timeout=30)
            assert got.correlation_data is not None
            seen[got.correlation_data] += 1
        # A barrier job published after every answer arrived: any duplicate of an earlier
        # answer would have been delivered before it (MQTT keeps per-topic order).
        client.submit(
            edge.settings.edge.id,
            images[0],
            response_topic=topic,
            correlation=b"barrier",
            user=[("model", "defect-v1")],
        )
        while (got := client.next(timeout=30)).correlation_data != b"barrier":
            assert got.correlation_data is not None
            seen[got.correlation_data] += 1
        client.close()
        if set(seen) != sent or any(c != 1 for c in seen.values()):
            dup = {c: n for c, n in seen.items() if n != 1}
            failures.append(f"client {k}: missing {sent - set(seen)}, duplicated {dup}")

    threads = [threading.Thread(target=one_client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


BAD_INPUTS = {
    "unknown model": (
        {"model": "defect-v9"},
        sample_jpeg()[0],
        "image/jpeg",
        "unknown_model",
        "unknown model 'defect-v9'; known: defect-v1",
    ),
    "corrupt jpeg": ({}, corrupt_jpeg(), "image/jpeg", "bad_image", "JPEG"),
    "empty payload": ({}, b"", "image/jpeg", "empty_payload", "payload is empty"),
    "over the limit": (
        {},
        b"\xff\xd8" + b"\x00" * LIMIT,
        "image/jpeg",
        "payload_too_large",
        f"limit is {LIMIT} bytes",
    ),
    "wrong content type": (
        {},
        sample_jpeg()[0],
        "application/pdf",
        "bad_content_type",
        "'image/jpeg' or 'image/png'",
    ),
    "non-numeric deadline": (
        {"deadline_ms": "tomorrow"},
        sample_jpeg()[0],
        "image/jpeg",
        "bad_property",
        "'deadline-ms'='tomorrow'",
    ),
    "negative deadline": (
        {"deadline_ms": "-20"},
        sample_jpeg()[0],
        "image/jpeg",
        "bad_property",
        "'deadline-ms'='-20'",
    ),
    "20000x20000 png": (
        {},
        png_header_only(20000, 20000),
        "image/png",
        "image_too_large",
        "20000x20000",
    ),
    "20000x20000 jpeg": (
        {},
        jpeg_header_only(20000, 20000),
        "image/jpeg",
        "image_too_large",
        "20000x20000",
    ),
}


def test_job_id_at_the_limit_is_accepted_and_past_it_refused(
    app: tuple[PlainClient, str], edge: AgentThread
) -> None:
    rule = "1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"
    longest = "L" + "0" * 127
    result = ask(app, edge, sample_jpeg()[0], job_id=longest)
    assert (result["status"], result["job_id"]) == ("ok", longest)
    for bad in (longest + "0", "lot-42:7"):
        result = ask(app, edge, sample_jpeg()[0], job_id=bad)
        assert (result["status"], result["code"], result["job_id"]) == (
            "rejected",
            "bad_property",
            bad,
        )
        assert result["reason"] == f"user property 'job-id'={bad!r} is invalid: expected {rule}"


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_is_rejected_and_the_agent_keeps_serving(
    case: str, app: tuple[PlainClient, str], edge: AgentThread
) -> None:
    props, payload, content_type, code, words = BAD_INPUTS[case]
    result = ask(app, edge, payload, content_type=content_type, **props)
    assert result["status"] == "rejected"
    assert result["code"] == code
    assert words in result["reason"]
    good = ask(app, edge, sample_jpeg()[0])
    assert good["status"] == "ok"


def _telemetry(client: PlainClient, edge_id: str, predicate: Any) -> dict[str, Any]:
    if edge_id not in client.subscribed:
        client.subscribe(topics.edge_telemetry(edge_id))
        client.subscribed.add(edge_id)
    while True:
        got = client.next(timeout=10)
        if got.topic == topics.edge_telemetry(edge_id):
            doc: dict[str, Any] = json.loads(got.payload)
            if predicate(doc):
                return doc


def test_no_response_topic_is_counted_not_answered(
    mosquitto: ServerProcess, app: tuple[PlainClient, str], edge: AgentThread
) -> None:
    watcher = PlainClient(mosquitto.port)
    before = _telemetry(watcher, edge.settings.edge.id, lambda d: True)
    client, _ = app
    client.submit(
        edge.settings.edge.id,
        sample_jpeg()[0],
        response_topic=None,
        user=[("model", "defect-v1")],
    )
    count = before["dropped_no_response_topic"]
    doc = _telemetry(
        watcher, edge.settings.edge.id, lambda d: d["dropped_no_response_topic"] > count
    )
    watcher.close()
    assert doc["dropped_no_response_topic"] == count + 1
    assert ask(app, edge, sample_jpeg()[0])["status"] == "ok"
    assert client.inbox.empty()  # nothing was published for the job without a topic


def test_job_past_its_deadline_is_answered_expired(
    app: tuple[PlainClient, str], edge: AgentThread
) -> None:
    past = str((time.time() - 5.0) * 1000.0)
    result = ask(app, edge, sample_jpeg()[0], deadline_at=past)
    assert result["status"] == "expired"
    assert "deadline passed" in result["reason"]
    assert "outputs" not in result


def test_job_whose_deadline_passes_in_the_queue_is_not_run(
    app: tuple[PlainClient, str], edge: AgentThread
) -> None:
    # One microsecond cannot cover the hop from admission to a worker: it expires queued.
    result = ask(app, edge, sample_jpeg()[0], deadline_ms="0.001")
    assert result["status"] == "expired"
    assert "before the job could start" in result["reason"]
    assert result["timings_ms"]["inference_ms"] == 0


def test_telemetry_reports_load(
    mosquitto: ServerProcess, app: tuple[PlainClient, str], edge: AgentThread
) -> None:
    assert ask(app, edge, sample_jpeg()[0])["status"] == "ok"
    watcher = PlainClient(mosquitto.port)
    doc = _telemetry(watcher, edge.settings.edge.id, lambda d: "defect-v1" in d["models"])
    watcher.close()
    assert doc["node"] == edge.settings.edge.id
    assert doc["queue_capacity"] == 512
    assert doc["models"]["defect-v1"]["service_ms"] > 0
    assert doc["memory_rss_mb"] > 10
    assert doc["results"]["ok"] >= 1
