"""Model manifests: a valid one loads; each kind of mistake is refused naming file and key."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from sluicegate.errors import ModelIntegrityError
from sluicegate.vision.manifest import (
    ClassificationPostprocess,
    DetectionPostprocess,
    ModelManifest,
    load_manifest,
)

VALID: dict[str, Any] = {
    "name": "defect-v1",
    "version": "1.0.0",
    "file": "defect-v1.onnx",
    "sha256": "ab" * 32,
    "opset": 17,
    "input": {
        "name": "image",
        "shape": [1, 3, 120, 160],
        "dtype": "float32",
        "layout": "NCHW",
        "color_order": "RGB",
    },
    "preprocess": {
        "resize": {"width": 160, "height": 120, "interpolation": "area"},
        "scale": 1 / 255,
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
    },
    "labels": ["ok", "scratch", "pit", "stain"],
    "postprocess": {"kind": "classification", "output": "scores", "softmax": False},
}


def _with(path: str, value: Any) -> dict[str, Any]:
    """VALID with the dotted key set to value (or removed when value is ...)."""
    doc = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node = doc
    for part in parents:
        node = node[part]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return doc


def _write(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def test_valid_manifest_loads(tmp_path: Path) -> None:
    m = load_manifest(_write(tmp_path, VALID))
    assert m.name == "defect-v1"
    assert (m.input.width, m.input.height) == (160, 120)
    assert isinstance(m.postprocess, ClassificationPostprocess)
    assert m.output_names == ["scores"]


def test_detection_kind_is_accepted(tmp_path: Path) -> None:
    post = {
        "kind": "detection",
        "boxes_output": "boxes",
        "scores_output": "scores",
        "score_threshold": 0.3,
        "iou_threshold": 0.5,
    }
    m = load_manifest(_write(tmp_path, _with("postprocess", post)))
    assert isinstance(m.postprocess, DetectionPostprocess)
    assert m.output_names == ["boxes", "scores"]


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("sha256", ..., "sha256: missing"),
        ("sha256", "xyz", "sha256: String should match pattern"),
        ("opset", 6, "opset: Input should be greater than or equal to 7"),
        ("file", "../../etc/passwd.onnx", "file: String should match pattern"),
        ("input.color_order", "RGBA", "input.color_order: Input should be 'RGB' or 'BGR'"),
        ("input.layout", "NHWC", "input.layout"),
        ("input.shape", [1, 3, 120], "input.shape"),
        ("preprocess.std", [0.25, 0.0, 0.25], "preprocess.std.1"),
        ("preprocess.resize.interpolation", "lanczos9", "preprocess.resize.interpolation"),
        ("preprocess.resize.width", 224, "preprocess.resize is 224x120 but input.shape"),
        ("labels", ["ok", "ok"], "labels must be unique"),
        ("labels", [], "labels"),
        ("postprocess.kind", "segmentation", "postprocess: Input tag 'segmentation'"),
        ("postprocess.output", ..., "postprocess.classification.output: missing"),
        ("surprise", 1, "surprise: Extra inputs are not permitted"),
    ],
)
def test_bad_manifest_names_file_and_key(
    tmp_path: Path, path: str, value: Any, expected: str
) -> None:
    bad = _write(tmp_path, _with(path, value))
    with pytest.raises(ModelIntegrityError) as info:
        load_manifest(bad)
    message = str(info.value)
    assert str(bad) in message
    assert expected in message


def test_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "m.json"
    bad.write_text('{\n  "name": "x",\n  oops\n}', encoding="utf-8")
    with pytest.raises(ModelIntegrityError, match=r"m\.json is not valid JSON: .* line 3"):
        load_manifest(bad)


def test_missing_manifest_file(tmp_path: Path) -> None:
    with pytest.raises(ModelIntegrityError, match=r"cannot read model manifest .*nope\.json"):
        load_manifest(tmp_path / "nope.json")


def test_manifest_is_frozen() -> None:
    m = ModelManifest.model_validate(VALID)
    with pytest.raises(ValueError, match="frozen"):
        m.name = "other"  # type: ignore[misc]
