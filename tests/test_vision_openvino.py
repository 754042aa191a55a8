"""The second backend: OpenVINO answers as ONNX Runtime does on every shipped model (the
same inputs through both, real runtimes: max absolute difference at most 1e-3, the same
labels and text), is chosen by provider name, and refuses a device it does not have."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from center_pool import reporting
from edge_agent.service import load_registry
from sluicegate.config import PoolSettings, load_settings
from sluicegate.errors import ModelError, ModelIntegrityError
from sluicegate.vision import label_synth, synth
from sluicegate.vision.openvino_session import OpenVinoSession, backend_of, openvino_devices
from sluicegate.vision.runtime import ModelRegistry, OcrModel, default_models_dir

pytest.importorskip("openvino")

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def both() -> tuple[ModelRegistry, ModelRegistry]:
    folder = default_models_dir()
    return ModelRegistry.from_dir(folder), ModelRegistry.from_dir(
        folder, providers=["OpenVINO/CPU"]
    )


def _images(count: int, *, labels: bool) -> list[bytes]:
    rng = np.random.default_rng(7)
    if labels:
        return [synth.encode_jpeg(label_synth.generate_label(rng).image) for _ in range(count)]
    return [synth.encode_jpeg(synth.generate(rng)[0]) for _ in range(count)]


def test_every_shipped_model_is_served_by_both(both: tuple[ModelRegistry, ModelRegistry]) -> None:
    ort_models, ov_models = both
    assert ov_models.names() == ort_models.names()
    assert {ov_models.get(n).session.get_providers()[0] for n in ov_models.names()} == {
        "OpenVINO/CPU"
    }


def test_the_backends_agree_on_every_shipped_model(
    both: tuple[ModelRegistry, ModelRegistry],
) -> None:
    ort_models, ov_models = both
    for name in ort_models.names():
        a, b = ort_models.get(name), ov_models.get(name)
        ocr = isinstance(a, OcrModel)
        for data in _images(4, labels=ocr):
            tensor, _d, _p, _frame = a.prepare(data)
            feed = {a.manifest.input.name: tensor}
            for x, y in zip(a.session.run(None, feed), b.session.run(None, feed), strict=True):
                assert x.shape == y.shape
                assert float(np.abs(x - y).max()) <= TOLERANCE, name
            got_a, _ = a.infer_bytes(data)
            got_b, _ = b.infer_bytes(data)
            assert got_a.label == got_b.label, name
            assert [d.label for d in got_a.detections] == [d.label for d in got_b.detections]
            assert [t.text for t in got_a.texts] == [t.text for t in got_b.texts], name
        if ocr:
            assert isinstance(b, OcrModel)
            lines = np.random.default_rng(3).uniform(-1, 1, (3, 3, 48, 320)).astype(np.float32)
            feed = {a.manifest.postprocess.recognizer.input: lines}  # type: ignore[union-attr]
            x, y = a.recogniser.run(None, feed)[0], b.recogniser.run(None, feed)[0]
            assert float(np.abs(x - y).max()) <= TOLERANCE
            assert a.charset == b.charset  # from OpenVINO's copy of the graph's metadata


def test_a_device_openvino_does_not_have_is_refused_naming_those_it_has() -> None:
    blob = (default_models_dir() / "defect-v1.onnx").read_bytes()
    with pytest.raises(ModelIntegrityError, match="OpenVINO has no device 'NPU7' here; it has CPU"):
        OpenVinoSession(blob, device="NPU7")
    with pytest.raises(ModelError, match=r"OpenVINO/NPU7 not available"):
        ModelRegistry.from_dir(default_models_dir(), providers=["OpenVINO/NPU7"])
    assert "CPU" in openvino_devices()


def test_a_worker_says_which_backend_and_device_each_model_runs_on(
    both: tuple[ModelRegistry, ModelRegistry], tmp_path: Path
) -> None:
    _ort, ov_models = both
    caps = reporting.capabilities(PoolSettings(), ov_models, ["OpenVINO/CPU"], 16_000)
    assert {m.backend for m in caps.models.values()} == {"openvino/CPU"}
    assert backend_of("CUDAExecutionProvider") == "onnxruntime/CUDAExecutionProvider"


def test_an_edge_serves_its_models_with_the_backend_its_settings_name() -> None:
    settings = load_settings(edge={"providers": ["OpenVINO/CPU"]})
    registry = load_registry(settings)
    assert registry.get("defect-v1").session.get_providers() == ["OpenVINO/CPU"]
    plain = load_registry(load_settings())
    assert plain.get("defect-v1").session.get_providers() == ["CPUExecutionProvider"]
