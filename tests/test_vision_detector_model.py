"""The shipped detector, served the way every node serves it (decode, letterbox, ONNX
Runtime, the yolov8 postprocess, boxes mapped back): on a fixed set of boxed surfaces it
finds what is there, and on a clean surface it finds nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest

from sluicegate import wire
from sluicegate.app.servers import ServerProcess
from sluicegate.vision import synth, synth_boxes
from sluicegate.vision.metrics import Prediction, Truth, mean_average_precision
from sluicegate.vision.runtime import LoadedModel, ModelRegistry, default_models_dir
from tests.support import sluicegate_cmd, start_agent_process

IMAGES = 60
SEED = 4242  # not the build's seed stream


@pytest.fixture(scope="module")
def detector() -> LoadedModel:
    return ModelRegistry.from_dir(default_models_dir()).get("surface-det")


def test_the_detector_finds_the_defects_on_a_fixed_set(detector: LoadedModel) -> None:
    rng = np.random.default_rng(SEED)
    predictions: list[list[Prediction]] = []
    truths: list[list[Truth]] = []
    for _ in range(IMAGES):
        image, defects = synth_boxes.generate(rng)
        h, w = image.shape[:2]
        outputs, _times = detector.infer_bytes(synth.encode_jpeg(image))
        predictions.append([(d.label, d.score, d.box) for d in outputs.detections])
        truths.append(
            [(d.label, (d.box[0] / w, d.box[1] / h, d.box[2] / w, d.box[3] / h)) for d in defects]
        )
    score = mean_average_precision(predictions, truths, labels=("scratch", "pit", "stain"))
    assert score.mean_ap >= 0.85, score  # 0.956 on the build's 1,000 held-out images


def test_a_clean_surface_has_no_detection(detector: LoadedModel) -> None:
    image, defects = synth_boxes.generate(np.random.default_rng(7), count=0)
    assert defects == ()
    outputs, _times = detector.infer_bytes(synth.encode_jpeg(image))
    assert outputs.detections == ()
    assert outputs.label is None


def test_a_result_with_nothing_found_reaches_the_app_as_sent(detector: LoadedModel) -> None:
    # The result document leaves out what is None; a detector that found nothing has no
    # label, and the app must still read the document.
    image, _ = synth_boxes.generate(np.random.default_rng(7), count=0)
    outputs, _times = detector.infer_bytes(synth.encode_jpeg(image))
    result = wire.JobResult(
        job_id="j-1",
        status="ok",
        model="surface-det",
        outputs=wire.outputs_of(outputs),
        ran_on=wire.RanOn(kind="edge", node="line-1-pc", zone="campus/line-1"),
        timings_ms=wire.Timings(),
    )
    sent = wire.dump(result)
    assert b'"label"' not in sent
    read = wire.JobResult.model_validate_json(sent)
    assert read.outputs is not None
    assert (read.outputs.label, read.outputs.detections) == (None, [])
    assert read == result


@pytest.mark.integration
def test_an_app_gets_the_answer_for_a_clean_part(mosquitto: ServerProcess, tmp_path: Path) -> None:
    edge_id = f"det-{uuid.uuid4().hex[:6]}"
    agent = start_agent_process(mosquitto.port, edge_id)
    try:
        image, _ = synth_boxes.generate(np.random.default_rng(7), count=0)
        path = tmp_path / "clean.jpg"
        path.write_bytes(synth.encode_jpeg(image))
        port = str(mosquitto.port)
        command = ("submit", str(path), "--model", "surface-det", "--edge", edge_id, "--port", port)
        got = subprocess.run(
            sluicegate_cmd(*command), capture_output=True, text=True, timeout=60, check=False
        )
        assert got.returncode == 0, got.stderr
        doc = json.loads(got.stdout)
        assert doc["status"] == "ok", doc
        assert doc["outputs"]["detections"] == []
        assert "label" not in doc["outputs"]
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(20)
