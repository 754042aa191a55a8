"""A new model version dropped into a node's folder is verified and served without a
restart: the watcher over a real folder and real ONNX Runtime sessions, then a real edge
agent process answering a stream of jobs across the swap, none lost, each result naming
the build that answered it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

import onnx
import pytest

from sluicegate import topics
from sluicegate.app.servers import ServerProcess
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from sluicegate.vision.watch import ModelWatcher, folder_signature
from tests.image_bytes import sample_jpeg
from tests.pool_kit import WORKER, WorkSpec
from tests.support import PlainClient, start_agent_process, until, wait_until
from tests.test_pool_memory import start

JPEG = sample_jpeg(3, "pit")[0]


def stage(folder: Path) -> Path:
    folder.mkdir()
    for name in ("defect-v1.json", "defect-v1.onnx"):
        shutil.copy(default_models_dir() / name, folder / name)
    return folder


def new_version(folder: Path, version: str, *, sha256: str | None = None) -> str:
    """defect-v1 rebuilt as ``version`` (another file: same graph, other metadata), written
    file first, manifest last, as a deployment copies them; returns the file's sha256."""
    model = onnx.load(str(default_models_dir() / "defect-v1.onnx"))
    onnx.helper.set_model_props(model, {"build": version})
    blob = model.SerializeToString()
    (folder / "defect-v1.onnx").write_bytes(blob)
    doc = json.loads((folder / "defect-v1.json").read_text())
    digest = hashlib.sha256(blob).hexdigest()
    doc |= {"version": version, "sha256": sha256 or digest}
    (folder / "defect-v1.json").write_text(json.dumps(doc))
    return digest


async def test_the_next_job_gets_the_new_version_and_a_running_one_keeps_the_old(
    tmp_path: Path,
) -> None:
    folder = stage(tmp_path / "models")
    registry = ModelRegistry.from_dir(folder)
    changes: list[list[str]] = []
    watcher = ModelWatcher(registry, folder, interval_s=0.02, changed=changes.append)
    running = registry.get("defect-v1")  # as a job in flight holds it
    task = asyncio.create_task(watcher.run())
    try:
        new_version(folder, "1.1.0")
        await until(lambda: changes, timeout=10)
        assert changes == [["defect-v1 1.0.0 -> 1.1.0"]]
        served = registry.get("defect-v1")
        assert served.manifest.version == "1.1.0"
        assert running.manifest.version == "1.0.0"
        old, _ = running.infer_bytes(JPEG)  # the old session still answers
        new, _ = served.infer_bytes(JPEG)
        assert (old.version, new.version) == ("1.0.0", "1.1.0")
        assert old.label == new.label == "pit"
    finally:
        task.cancel()


async def test_a_version_that_does_not_verify_is_not_served_and_the_fixed_one_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = stage(tmp_path / "models")
    registry = ModelRegistry.from_dir(folder)
    watcher = ModelWatcher(registry, folder, interval_s=0.02)
    task = asyncio.create_task(watcher.run())
    try:
        new_version(folder, "1.2.0", sha256="0" * 64)  # the manifest pins another file
        await until(lambda: "not reloaded, still serving the previous ones" in caplog.text, 10)
        assert "does not match its manifest" in caplog.text
        assert registry.get("defect-v1").manifest.version == "1.0.0"
        new_version(folder, "1.2.1")
        await until(lambda: registry.get("defect-v1").manifest.version == "1.2.1", 10)
    finally:
        task.cancel()


def test_the_signature_covers_the_files_a_manifest_names(tmp_path: Path) -> None:
    folder = stage(tmp_path / "models")
    before = folder_signature(folder)
    assert [name for name, _size, _mtime in before] == ["defect-v1.json", "defect-v1.onnx"]
    (folder / "defect-v1.onnx").write_bytes(b"half a model")
    assert folder_signature(folder) != before


@pytest.mark.integration
def test_an_edge_serves_the_new_version_across_a_stream_of_jobs_and_loses_none(
    mosquitto: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = stage(tmp_path / "models")
    monkeypatch.setenv("SLUICEGATE_EDGE__MODELS_RELOAD_S", "0.1")
    edge_id = f"reload-{uuid.uuid4().hex[:6]}"
    agent = start_agent_process(mosquitto.port, edge_id, "--models-dir", str(folder))
    app = PlainClient(mosquitto.port)
    reply_to = f"app/reload/{edge_id}"
    app.subscribe(reply_to)
    results: dict[str, dict[str, Any]] = {}
    sent: list[str] = []

    def send() -> None:
        job = f"j{len(sent):04d}"
        sent.append(job)
        app.submit(
            edge_id,
            JPEG,
            response_topic=reply_to,
            user=[(topics.PROP_MODEL, "defect-v1"), (topics.PROP_JOB_ID, job)],
        )

    def collect() -> None:
        while len(results) < len(sent):
            doc = json.loads(app.next(timeout=15).payload)
            results[doc["job_id"]] = doc

    try:
        for _ in range(20):
            send()
        collect()
        sha = new_version(folder, "1.1.0")
        # Jobs keep coming while the folder changes, until one is answered by the new build.
        wait_until(
            lambda: (
                (send(), collect(), results[sent[-1]])[2]["outputs"]["model_version"] == "1.1.0"
            ),
            30,
        )
        for _ in range(20):
            send()
        collect()
        assert sorted(results) == sorted(sent)  # every job answered, once
        assert {r["status"] for r in results.values()} == {"ok"}
        versions = [results[job]["outputs"]["model_version"] for job in sent]
        first_new = versions.index("1.1.0")
        assert set(versions[:first_new]) == {"1.0.0"}
        assert set(versions[first_new:]) == {"1.1.0"}  # never back to the old one
        assert results[sent[-1]]["outputs"]["model_sha256"] == sha
    finally:
        app.close()
        agent.send_signal(signal.SIGTERM)
        agent.wait(20)


async def test_a_worker_serves_the_new_version_and_tells_the_broker(tmp_path: Path) -> None:
    folder = stage(tmp_path / "models")
    pool = await start(
        tmp_path, registry=ModelRegistry.from_dir(folder), models_dir=folder, models_reload_s=0.05
    )
    try:
        caps = topics.worker_capabilities(WORKER)

        def held() -> str:
            return str(
                json.loads(pool.broker.retained[caps].payload)["models"]["defect-v1"]["sha256"]
            )

        old = held()
        first = await pool.result_for(pool.send(WorkSpec(model_sha256=old)))
        assert (first["status"], first["outputs"]["model_version"]) == ("ok", "1.0.0")
        sha = new_version(folder, "1.1.0")
        await until(lambda: held() == sha, 10)  # the retained capabilities name the new file
        second = await pool.result_for(pool.send(WorkSpec(model_sha256=sha)))
        assert (second["status"], second["outputs"]["model_version"]) == ("ok", "1.1.0")
        stale = await pool.result_for(pool.send(WorkSpec(model_sha256=old)))
        assert stale["code"] == "model_version"  # placed before the swap: not run on the new file
    finally:
        await pool.close()
