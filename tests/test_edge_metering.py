"""The edge's usage records: which concluded jobs get one and what it says (pure), and a
real edge agent on a real Mosquitto writing, signing and shipping them (real tier)."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_agent.admission import Job
from edge_agent.metering import Concluded, edge_record
from policies.keys import SigningKey
from sluicegate import topics, wire
from sluicegate.app.servers import ServerProcess
from sluicegate.config import load_settings
from sluicegate.metering.record import GENESIS, Usage
from sluicegate.metering.wire import decode_batch
from sluicegate.vision.image import ImageInfo
from sluicegate.vision.runtime import ModelRegistry, StageTimes, default_models_dir
from tests.image_bytes import sample_jpeg
from tests.support import AgentThread, PlainClient, installed_policy

EDGE, ZONE = "line-1-pc", "campus/fab-north/line-1"


def _draft(**fields: Any) -> Usage:
    return Usage(node=EDGE, kind="edge", seq=1, prev=GENESIS.hex(), at_ms=1, **fields)


def _job() -> Job:
    return Job(
        job_id="j-1",
        model="defect-v1",
        payload=b"\xff\xd8image\xff\xd9",
        image=ImageInfo("jpeg", 64, 64),
        response_topic="app/line-1/results",
        correlation_data=None,
        priority=5,
        data_class="wafer-image",
        received_at=100.0,
        deadline=None,
    )


def _result(kind: str, node: str, zone: str, status: str = "ok") -> wire.JobResult:
    return wire.JobResult(
        job_id="j-1",
        status=status,  # type: ignore[arg-type]
        ran_on=wire.RanOn(kind=kind, node=node, zone=zone),  # type: ignore[arg-type]
        timings_ms=wire.Timings(queue_ms=2.0, total_ms=9.0),
    )


def _record(done: Concluded) -> Usage | None:
    return edge_record(
        _draft,
        done,
        edge_id=EDGE,
        zone=ZONE,
        owner="app-line-1",
        model_sha256="ab" * 32,
        backend="onnxruntime/CPUExecutionProvider",
        device_class="x86-cpu",
    )


def test_a_job_run_here_is_its_own_settlement_with_its_device_time() -> None:
    times = StageTimes(decode_ms=1.0, preprocess_ms=0.5, inference_ms=3.25)
    payload = b'{"result": 1}'
    done = Concluded(_job(), _result("edge", EDGE, ZONE), payload, times, False, 0)
    record = _record(done)
    assert record is not None
    assert (record.event, record.attempt, record.device_us, record.queue_us) == (
        "ran",
        0,
        4750,
        2000,
    )
    assert record.result_sha256 == hashlib.sha256(payload).hexdigest()
    assert (record.owner, record.line, record.zone) == ("app-line-1", EDGE, ZONE)
    assert record.model_sha256 == "ab" * 32
    assert record.bytes_in == len(_job().payload)


def test_an_offloaded_job_is_settled_on_the_attempt_delivered() -> None:
    result = _result("pool", "north-cpu-1", "campus/fab-north/dc")
    record = _record(Concluded(_job(), result, b"doc", None, True, 2))
    assert record is not None
    assert (record.event, record.settled_node, record.settled_attempt) == (
        "settled",
        "north-cpu-1",
        2,
    )
    assert record.device_us == 0
    assert record.zone == "campus/fab-north/dc"


def test_a_placed_job_concluded_without_a_workers_result_settles_on_nothing() -> None:
    expired = _result("edge", EDGE, ZONE, status="expired")
    record = _record(Concluded(_job(), expired, b"doc", None, True, 0))
    assert record is not None
    assert (record.event, record.settled_node, record.settled_attempt) == ("settled", "", 0)


def test_a_job_neither_run_nor_placed_costs_nothing() -> None:
    refused = _result("edge", EDGE, ZONE, status="expired")
    assert _record(Concluded(_job(), refused, b"doc", None, False, 0)) is None


# -- real tier --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metered_edge(
    mosquitto: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[AgentThread, SigningKey]]:
    state = tmp_path_factory.mktemp("metered-edge")
    key = SigningKey.generate()
    key_file = state / "edge.key"
    key_file.write_bytes(key.to_pem())
    settings = load_settings(
        mqtt={"port": mosquitto.port, "plaintext": True},
        offload={"policy_file": installed_policy(), "state_dir": str(state)},
        edge={
            "id": f"edge-{uuid.uuid4().hex[:8]}",
            "zone": "campus/test/line-1",
            "key_file": str(key_file),
            "device_class": "line-pc-x86",
        },
    )
    watcher = PlainClient(mosquitto.port)
    agent = AgentThread(settings, ModelRegistry.from_dir(default_models_dir()))
    agent.start(watcher)
    watcher.close()
    yield agent, key
    agent.stop()


@pytest.mark.integration
def test_a_real_edge_writes_signs_and_ships_a_record_per_job_it_ran(
    mosquitto: ServerProcess, metered_edge: tuple[AgentThread, SigningKey]
) -> None:
    agent, key = metered_edge
    edge_id = agent.settings.edge.id
    usage = PlainClient(mosquitto.port)
    usage.subscribe(topics.usage(edge_id))
    app = PlainClient(mosquitto.port)
    results_topic = f"tests/{uuid.uuid4().hex[:8]}/results"
    app.subscribe(results_topic)
    image, _label = sample_jpeg()
    delivered: dict[str, dict[str, Any]] = {}
    for i in range(3):
        job_id = f"metered-{i}"
        app.submit(
            edge_id,
            image,
            response_topic=results_topic,
            user=[(topics.PROP_MODEL, "defect-v1"), (topics.PROP_JOB_ID, job_id)],
        )
        got = json.loads(app.next().payload)
        delivered[got["job_id"]] = got
    seen: dict[str, Usage] = {}
    while len(seen) < 3:
        for line in decode_batch(usage.next().payload):
            assert not hasattr(line, "reason"), line
            assert line.node_signature_valid(key.public)  # type: ignore[union-attr]
            seen[line.record.job_id] = line.record  # type: ignore[union-attr]
    usage.close()
    app.close()
    assert set(seen) == set(delivered)
    seqs = sorted(r.seq for r in seen.values())
    assert seqs == list(range(seqs[0], seqs[0] + 3))  # numbered, no gap
    for job_id, record in seen.items():
        result = delivered[job_id]
        assert (record.event, record.kind, record.status) == ("ran", "edge", result["status"])
        assert record.device_class == "line-pc-x86"
        assert record.device_us == pytest.approx(result["timings_ms"]["device_ms"] * 1000, abs=2)
        assert record.device_us > 0
    # The records live in the outbox's file: no ledger file of their own.
    state = Path(agent.settings.offload.state_dir or ".")
    assert (state / f"edge-{edge_id}.outbox.db").exists()
    assert not (state / f"edge-{edge_id}.usage.sqlite").exists()


def test_an_edge_with_no_readable_key_serves_unmetered_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from edge_agent.service import edge_meter, open_outbox
    from sluicegate.memory_transport import MemoryBroker, MemoryTransport

    base = {"mqtt": {"plaintext": True}, "offload": {"state_dir": str(tmp_path)}}
    off = load_settings(**base, edge={"id": "e1", "metering": False})
    outbox = open_outbox(off)
    assert edge_meter(off, MemoryTransport(MemoryBroker()), outbox) is None
    missing = load_settings(**base, edge={"id": "e1", "key_file": str(tmp_path / "none.key")})
    assert edge_meter(missing, MemoryTransport(MemoryBroker()), outbox) is None
    assert "not metered" in caplog.text
    assert "cannot read key file" in caplog.text
    key_file = tmp_path / "e1.key"
    key_file.write_bytes(SigningKey.generate().to_pem())
    keyed = load_settings(**base, edge={"id": "e1", "key_file": str(key_file)})
    meter = edge_meter(keyed, MemoryTransport(MemoryBroker()), outbox)
    assert meter is not None
    assert meter.ledger.path == outbox.path == tmp_path / "edge-e1.outbox.db"
