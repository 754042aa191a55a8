"""Model registry and runtime: integrity checks, lookups, and the end-to-end image path.

Registry mechanics use a tiny hand-made ONNX model (mean colour per channel); the accuracy
test uses the committed defect-v1 model on fresh images from a seed the build never used.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from sluicegate.errors import ImageTooLargeError, ModelError, ModelIntegrityError, UnknownModelError
from sluicegate.vision import synth
from sluicegate.vision.runtime import (
    LoadedModel,
    ModelRegistry,
    StageTimes,
    default_models_dir,
)

# Seeds the model build never uses (it draws from [seed, stream, index] with seed 20240611).
ACCURACY_SEED = 424242
ACCURACY_IMAGES = 300


def _tiny_onnx(input_name: str = "image") -> bytes:
    """[N,3,8,8] -> the mean of each channel, [N,3]: a 'which colour is it' classifier."""
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", [input_name], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["scores"], axis=1),
        ],
        "tiny",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _tiny_manifest(blob: bytes, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "tiny-v1",
        "version": "1",
        "file": "tiny-v1.onnx",
        "sha256": hashlib.sha256(blob).hexdigest(),
        "opset": 17,
        "input": {"name": "image", "shape": [1, 3, 8, 8], "color_order": "RGB"},
        "preprocess": {"resize": {"width": 8, "height": 8}, "scale": 1 / 255},
        "labels": ["red", "green", "blue"],
        "postprocess": {"kind": "classification", "output": "scores", "softmax": True},
    }
    doc.update(changes)
    return doc


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    blob = _tiny_onnx()
    (tmp_path / "tiny-v1.onnx").write_bytes(blob)
    (tmp_path / "tiny-v1.json").write_text(json.dumps(_tiny_manifest(blob)), encoding="utf-8")
    return tmp_path


def test_registry_loads_and_runs(tiny_dir: Path) -> None:
    registry = ModelRegistry.from_dir(tiny_dir)
    assert registry.names() == ["tiny-v1"]
    model = registry.get("tiny-v1")
    red = np.zeros((40, 40, 3), np.uint8)
    red[..., 2] = 255  # BGR
    outputs, times = model.infer_bytes(synth.encode_png(red))
    assert outputs.label == "red"  # the BGR -> RGB swap happened
    assert isinstance(times, StageTimes)
    assert min(times.decode_ms, times.preprocess_ms, times.inference_ms) >= 0
    assert times.total_ms == pytest.approx(
        times.decode_ms + times.preprocess_ms + times.inference_ms
    )


def test_batch_run_gives_one_result_per_item(tiny_dir: Path) -> None:
    model = ModelRegistry.from_dir(tiny_dir).get("tiny-v1")
    batch = np.zeros((3, 3, 8, 8), np.float32)
    for i in range(3):
        batch[i, i] = 1.0
    assert [o.label for o in model.run(batch)] == ["red", "green", "blue"]


def test_unknown_model_names_the_known_ones(tiny_dir: Path) -> None:
    with pytest.raises(UnknownModelError, match=r"^unknown model 'defect-v9'; known: tiny-v1$"):
        ModelRegistry.from_dir(tiny_dir).get("defect-v9")


def test_sha256_mismatch_is_refused(tiny_dir: Path) -> None:
    manifest = json.loads((tiny_dir / "tiny-v1.json").read_text())
    tampered = _tiny_onnx().replace(b"tiny", b"tinY")
    (tiny_dir / "tiny-v1.onnx").write_bytes(tampered)
    with pytest.raises(ModelIntegrityError) as info:
        ModelRegistry.from_dir(tiny_dir)
    message = str(info.value)
    assert "tiny-v1.onnx" in message
    assert "tiny-v1.json" in message
    assert f"expected sha256 {manifest['sha256']}" in message
    assert f"actual {hashlib.sha256(tampered).hexdigest()}" in message


def test_missing_model_file(tiny_dir: Path) -> None:
    (tiny_dir / "tiny-v1.onnx").unlink()
    with pytest.raises(ModelIntegrityError, match=r"tiny-v1\.onnx named by .*cannot be read"):
        ModelRegistry.from_dir(tiny_dir)


def test_manifest_must_match_the_graph(tmp_path: Path) -> None:
    blob = _tiny_onnx(input_name="pixels")
    (tmp_path / "tiny-v1.onnx").write_bytes(blob)
    (tmp_path / "tiny-v1.json").write_text(json.dumps(_tiny_manifest(blob)))
    with pytest.raises(ModelIntegrityError, match="manifest input 'image' is not a graph input"):
        ModelRegistry.from_dir(tmp_path)


def test_wrong_input_size_in_manifest(tmp_path: Path) -> None:
    blob = _tiny_onnx()
    (tmp_path / "tiny-v1.onnx").write_bytes(blob)
    doc = _tiny_manifest(
        blob,
        input={"name": "image", "shape": [1, 3, 16, 16], "color_order": "RGB"},
        preprocess={"resize": {"width": 16, "height": 16}, "scale": 1 / 255},
    )
    (tmp_path / "tiny-v1.json").write_text(json.dumps(doc))
    with pytest.raises(ModelIntegrityError, match=r"has shape \['batch', 3, 8, 8\]"):
        ModelRegistry.from_dir(tmp_path)


def test_duplicate_model_names(tiny_dir: Path) -> None:
    shutil.copy(tiny_dir / "tiny-v1.json", tiny_dir / "copy.json")
    with pytest.raises(ModelIntegrityError, match="'tiny-v1' is declared by both"):
        ModelRegistry.from_dir(tiny_dir)


def test_missing_or_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelIntegrityError, match="SLUICEGATE_MODELS_DIR"):
        ModelRegistry.from_dir(tmp_path / "absent")
    with pytest.raises(ModelIntegrityError, match=r"no model manifests \(\*\.json\)"):
        ModelRegistry.from_dir(tmp_path)


def test_unavailable_provider(tiny_dir: Path) -> None:
    with pytest.raises(ModelError, match=r"NoSuchExecutionProvider not available.*CPU"):
        ModelRegistry.from_dir(tiny_dir, providers=["NoSuchExecutionProvider"])


def test_limits_are_checked_before_decoding(tiny_dir: Path) -> None:
    model = ModelRegistry.from_dir(tiny_dir).get("tiny-v1")
    data = synth.encode_png(np.zeros((100, 300, 3), np.uint8))
    with pytest.raises(ImageTooLargeError, match="100 pixels"):
        model.infer_bytes(data, max_pixels=10**6, max_side=100)
    model.infer_bytes(data, max_pixels=30_000, max_side=300)


def test_default_models_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SLUICEGATE_MODELS_DIR", raising=False)
    assert (default_models_dir() / "defect-v1.json").is_file()
    monkeypatch.setenv("SLUICEGATE_MODELS_DIR", str(tmp_path))
    assert default_models_dir() == tmp_path


# --- the committed model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def defect() -> LoadedModel:
    return ModelRegistry.from_dir(default_models_dir()).get("defect-v1")


def test_committed_model_matches_its_manifest(defect: LoadedModel) -> None:
    m = defect.manifest
    assert m.labels == synth.LABELS
    assert m.opset >= 17
    assert (default_models_dir() / m.file).stat().st_size <= 5 * 1024 * 1024


def test_committed_model_accuracy_on_fresh_images(defect: LoadedModel) -> None:
    right = 0
    wrong: list[tuple[int, str, str | None]] = []
    for i in range(ACCURACY_IMAGES):
        img, label = synth.generate(np.random.default_rng([ACCURACY_SEED, i]))
        outputs, _ = defect.infer_bytes(synth.encode_jpeg(img, 90))
        if outputs.label == label:
            right += 1
        else:
            wrong.append((i, label, outputs.label))
    assert right / ACCURACY_IMAGES >= 0.95, f"{right}/{ACCURACY_IMAGES} right; wrong: {wrong}"


def test_committed_model_on_png_and_in_batches(defect: LoadedModel) -> None:
    images = [
        synth.generate(np.random.default_rng([ACCURACY_SEED, 10_000 + i]), label)
        for i, label in enumerate(synth.LABELS * 3)
    ]
    singles = [defect.infer_bytes(synth.encode_png(img))[0] for img, _ in images]
    right = sum(o.label == label for o, (_, label) in zip(singles, images, strict=True))
    assert right >= len(images) - 1
    batch = np.concatenate([defect.prepare(synth.encode_png(img))[0] for img, _ in images])
    batched = defect.run(batch)
    assert [o.label for o in batched] == [o.label for o in singles]
    for a, b in zip(batched, singles, strict=True):
        assert a.scores == pytest.approx(b.scores, abs=1e-5)
