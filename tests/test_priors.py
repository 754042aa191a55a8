"""Service-time priors: measured on the real models (real ONNX Runtime), written and read
back, kept only for the very file and backend they were measured on, refused clearly when
the file is not priors, and taken up by a real edge agent, whose first telemetry reports
them before it has run a job."""

from __future__ import annotations

import json
import shutil
import signal
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from center_pool.reporting import ServiceStats
from sluicegate import topics
from sluicegate.app.cli import app
from sluicegate.app.servers import ServerProcess
from sluicegate.errors import ConfigError
from sluicegate.vision.priors import (
    PRIORS_FILE,
    Prior,
    measure,
    priors_for,
    read_priors,
    write_priors,
)
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from tests.support import PlainClient, start_agent_process


def stage(folder: Path) -> Path:
    folder.mkdir()
    for name in ("defect-v1.json", "defect-v1.onnx"):
        shutil.copy(default_models_dir() / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry.from_dir(default_models_dir())


def test_every_model_is_measured_for_its_file_and_backend(registry: ModelRegistry) -> None:
    found = {p.model: p for p in measure(registry, batch=4, runs=3, now=1.0)}
    assert set(found) == set(registry.names())
    defect = found["defect-v1"]
    assert defect.sha256 == registry.get("defect-v1").manifest.sha256
    assert defect.backend == "onnxruntime/CPUExecutionProvider"
    assert (defect.batch, defect.runs, defect.measured_at) == (4, 3, 1.0)
    assert defect.image_ms > 0
    assert defect.batch_ms > 0
    assert found["ocr-ppocrv4"].batch == 1  # one image per run: its images differ in size


def _prior(model: str = "defect-v1", sha256: str = "ab" * 32, **kw: object) -> Prior:
    doc = {
        "model": model,
        "sha256": sha256,
        "backend": "onnxruntime/CPUExecutionProvider",
        "image_ms": 3.0,
        "batch": 8,
        "batch_ms": 9.0,
        "runs": 30,
        "measured_at": 1.0,
        **kw,
    }
    return Prior.model_validate(doc)


def test_priors_are_kept_per_model_and_backend_and_fit_only_the_same_file(
    tmp_path: Path, registry: ModelRegistry
) -> None:
    path = tmp_path / PRIORS_FILE
    sha = registry.get("defect-v1").manifest.sha256
    write_priors(path, [_prior(sha256=sha), _prior(backend="openvino/CPU", sha256=sha)])
    write_priors(path, [_prior(sha256=sha, image_ms=2.5)])  # measured again: replaces its own
    priors = read_priors(path)
    assert sorted((p.backend, p.image_ms) for p in priors) == [
        ("onnxruntime/CPUExecutionProvider", 2.5),
        ("openvino/CPU", 3.0),
    ]
    fit = priors_for(registry, [*priors, _prior(model="gone"), _prior(model="ocr-ppocrv4")])
    assert {name: p.image_ms for name, p in fit.items()} == {"defect-v1": 2.5}
    assert read_priors(tmp_path / "none.priors") == []


def test_a_file_that_is_not_priors_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / PRIORS_FILE
    path.write_text(json.dumps({"v": 1, "priors": [{"model": "x"}]}))
    with pytest.raises(ConfigError, match=rf"{PRIORS_FILE} are not valid \(priors.0.sha256"):
        read_priors(path)


def test_a_pool_worker_reports_its_priors_before_its_first_job() -> None:
    stats = ServiceStats()
    stats.seed("defect-v1", 3.0, 9.0)
    stats.seed("defect-v1", 99.0, 99.0)  # a second seed changes nothing
    assert stats.loads()["defect-v1"].service_ms == 3.0
    assert stats.batch_estimate_s("defect-v1") == pytest.approx(0.009)
    stats.observe("defect-v1", 5.0, 1)  # real jobs move it from there
    assert 3.0 < stats.loads()["defect-v1"].service_ms < 5.0


def test_models_bench_writes_the_node_s_priors(tmp_path: Path) -> None:
    folder = stage(tmp_path / "models")
    result = CliRunner().invoke(
        app,
        [
            "models",
            "bench",
            "--models-dir",
            str(folder),
            "--runs",
            "3",
            "--providers",
            "CPUExecutionProvider",
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"priors written to {folder / PRIORS_FILE}" in result.output
    (prior,) = read_priors(folder / PRIORS_FILE)
    assert (prior.model, prior.backend, prior.batch) == (
        "defect-v1",
        "onnxruntime/CPUExecutionProvider",
        8,
    )
    assert "defect-v1" in result.output
    bad = CliRunner().invoke(app, ["models", "bench", "--models-dir", str(tmp_path / "nowhere")])
    assert bad.exit_code == 2
    assert "does not exist" in bad.output


@pytest.mark.integration
def test_an_edge_starts_from_its_priors(mosquitto: ServerProcess, tmp_path: Path) -> None:
    folder = stage(tmp_path / "models")
    sha = ModelRegistry.from_dir(folder).get("defect-v1").manifest.sha256
    write_priors(folder / PRIORS_FILE, [_prior(sha256=sha, image_ms=42.0)])
    edge_id = f"priors-{uuid.uuid4().hex[:6]}"
    watcher = PlainClient(mosquitto.port)
    watcher.subscribe(topics.edge_telemetry(edge_id))
    agent = start_agent_process(mosquitto.port, edge_id, "--models-dir", str(folder))
    try:
        telemetry = json.loads(watcher.next(timeout=15).payload)
        assert telemetry["models"]["defect-v1"] == {"service_ms": 42.0, "completed": 0}
    finally:
        watcher.close()
        agent.send_signal(signal.SIGTERM)
        agent.wait(20)
