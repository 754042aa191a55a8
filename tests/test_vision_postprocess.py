"""Postprocessing: classification scores, and detection boxes with per-label NMS."""

from __future__ import annotations

import copy
from typing import Any

import cv2
import numpy as np
import pytest
from test_vision_manifest import VALID

from sluicegate.errors import OutputError
from sluicegate.vision.manifest import ModelManifest
from sluicegate.vision.postprocess import Detection, Outputs, nms, postprocess

LABELS = ["ok", "scratch", "pit", "stain"]


def _classifier(softmax: bool) -> ModelManifest:
    doc = copy.deepcopy(VALID)
    doc["postprocess"] = {"kind": "classification", "output": "scores", "softmax": softmax}
    return ModelManifest.model_validate(doc)


def _detector(**post: Any) -> ModelManifest:
    doc = copy.deepcopy(VALID)
    doc["labels"] = ["scratch", "pit"]
    doc["postprocess"] = {
        "kind": "detection",
        "boxes_output": "boxes",
        "scores_output": "scores",
        "score_threshold": 0.3,
        "iou_threshold": 0.5,
        **post,
    }
    return ModelManifest.model_validate(doc)


def test_classification_probabilities_one_output_per_batch_item() -> None:
    probs = np.array([[0.7, 0.1, 0.1, 0.1], [0.05, 0.05, 0.8, 0.1], [0.1, 0.2, 0.3, 0.4]])
    out = postprocess([probs.astype(np.float32)], _classifier(softmax=False))
    assert [o.label for o in out] == ["ok", "pit", "stain"]
    assert out[1].scores == pytest.approx({"ok": 0.05, "scratch": 0.05, "pit": 0.8, "stain": 0.1})
    assert out[0].detections == ()


def test_classification_softmax_of_logits() -> None:
    logits = np.array([[0.0, 2.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0]], np.float32)
    out = postprocess([logits], _classifier(softmax=True))
    assert out[0].label == "scratch"
    assert sum(out[0].scores.values()) == pytest.approx(1.0)
    e = np.exp(2.0)
    assert out[0].scores["scratch"] == pytest.approx(e / (e + 3), rel=1e-6)
    assert out[1].scores["ok"] == pytest.approx(1.0)  # no overflow with large logits


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ([np.zeros((1, 3), np.float32)], r"shape \[1, 3\]; expected \[N, 4\]"),
        ([np.zeros((4,), np.float32)], "expected"),
        ([np.zeros((1, 4)), np.zeros((1, 4))], "expected 1 output tensor"),
    ],
)
def test_classification_refuses_wrong_shapes(raw: list[np.ndarray], match: str) -> None:
    with pytest.raises(OutputError, match=match):
        postprocess(raw, _classifier(softmax=False))


def _det_raw(boxes: list[list[float]], scores: list[list[float]]) -> list[np.ndarray]:
    return [np.array([boxes], np.float32), np.array([scores], np.float32)]


def test_detection_nms_keeps_the_best_of_overlapping_boxes_per_label() -> None:
    # Input is 160x120 pixels, boxes in pixels, xyxy.
    boxes = [
        [10, 10, 50, 50],  # scratch 0.9
        [12, 12, 52, 52],  # scratch 0.8: overlaps the first (IoU ~0.82) -> suppressed
        [11, 11, 51, 51],  # pit 0.7: same place, other label -> kept
        [100, 60, 140, 100],  # scratch 0.6: elsewhere -> kept
        [0, 0, 160, 120],  # below threshold for both -> dropped
    ]
    scores = [[0.9, 0.0], [0.8, 0.1], [0.1, 0.7], [0.6, 0.0], [0.2, 0.29]]
    (out,) = postprocess(_det_raw(boxes, scores), _detector())
    assert out.label == "scratch"
    assert [d.label for d in out.detections] == ["scratch", "pit", "scratch"]
    assert [d.score for d in out.detections] == pytest.approx([0.9, 0.7, 0.6])
    assert out.detections[0].box == pytest.approx((10 / 160, 10 / 120, 50 / 160, 50 / 120))
    assert out.scores == pytest.approx({"scratch": 0.9, "pit": 0.7})


def test_detection_cxcywh_normalised_and_clipped() -> None:
    boxes = [[0.5, 0.5, 0.2, 0.4], [0.95, 0.5, 0.2, 0.2]]
    scores = [[0.9, 0.0], [0.0, 0.8]]
    manifest = _detector(box_format="cxcywh", normalized=True)
    (out,) = postprocess(_det_raw(boxes, scores), manifest)
    assert out.detections[0] == Detection(
        "scratch", pytest.approx(0.9), pytest.approx((0.4, 0.3, 0.6, 0.7))
    )
    assert out.detections[1].box == pytest.approx((0.85, 0.4, 1.0, 0.6))


def test_detection_nothing_found_and_max_detections() -> None:
    (empty,) = postprocess(_det_raw([[0, 0, 1, 1]], [[0.1, 0.1]]), _detector())
    assert empty == Outputs(label=None, scores={"scratch": 0.0, "pit": 0.0}, detections=())
    boxes = [[i * 10, 0, i * 10 + 8, 8] for i in range(10)]
    scores = [[0.5 + i / 100, 0.0] for i in range(10)]
    (few,) = postprocess(_det_raw(boxes, scores), _detector(max_detections=3))
    assert [d.score for d in few.detections] == pytest.approx([0.59, 0.58, 0.57])


def test_detection_batch_and_shape_checks() -> None:
    boxes = np.zeros((3, 5, 4), np.float32)
    scores = np.zeros((3, 5, 2), np.float32)
    scores[1, 2, 1] = 0.9
    boxes[1, 2] = (10, 10, 20, 20)
    out = postprocess([boxes, scores], _detector())
    assert [o.label for o in out] == [None, "pit", None]
    with pytest.raises(OutputError, match=r"'scores' has shape \[3, 5, 3\]; expected \[N, K, 2\]"):
        postprocess([boxes, np.zeros((3, 5, 3), np.float32)], _detector())
    with pytest.raises(OutputError, match=r"expected \[N, K, 4\]"):
        postprocess([np.zeros((3, 5), np.float32), scores], _detector())


def test_nms_agrees_with_opencv_on_random_boxes() -> None:
    rng = np.random.default_rng(11)
    xy = rng.uniform(0, 100, (200, 2))
    wh = rng.uniform(5, 40, (200, 2))
    boxes = np.hstack([xy, xy + wh]).astype(np.float32)
    scores = rng.uniform(0, 1, 200).astype(np.float32)
    for threshold in (0.3, 0.5, 0.7):
        ours = nms(boxes, scores, threshold)
        theirs = cv2.dnn.NMSBoxes(np.hstack([xy, wh]).tolist(), scores.tolist(), 0.0, threshold)
        assert sorted(ours.tolist()) == sorted(np.asarray(theirs).ravel().tolist())


def test_nms_empty() -> None:
    assert nms(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), 0.5).size == 0
