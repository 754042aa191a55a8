"""Detector and anomaly outputs in the layouts real exporters write, read as tables: each
layout's encoding of the same boxes, the degenerate answers (nothing, everything, NaN, the
wrong shape), letterbox geometry there and back, and anomaly maps into regions."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
from test_vision_manifest import VALID

from sluicegate.errors import OutputError
from sluicegate.vision.geometry import Frame, fit, to_image
from sluicegate.vision.manifest import ModelManifest
from sluicegate.vision.postprocess import postprocess
from sluicegate.vision.preprocess import frame_of, preprocess

LABELS = ["scratch", "pit", "stain"]
SIZE = 64  # a square 64x64 input
STRIDES = (8, 16, 32)
YOLOX_ANCHORS = sum((SIZE // s) ** 2 for s in STRIDES)  # 64 + 16 + 4


def _manifest(
    post: dict[str, Any], *, labels: list[str] = LABELS, mode: str = "stretch"
) -> ModelManifest:
    doc = copy.deepcopy(VALID)
    doc["input"]["shape"] = [1, 3, SIZE, SIZE]
    doc["preprocess"]["resize"] = {"width": SIZE, "height": SIZE, "mode": mode}
    doc["labels"] = labels
    doc["postprocess"] = {"kind": "detection", "score_threshold": 0.3, **post}
    return ModelManifest.model_validate(doc)


Box = tuple[float, float, float, float]  # xyxy, input pixels


def _cxcywh(box: Box) -> list[float]:
    x1, y1, x2, y2 = box
    return [(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1]


def yolov8(rows: list[tuple[Box, int, float]], anchors: int = 20) -> list[np.ndarray]:
    out = np.zeros((1, 4 + len(LABELS), anchors), np.float32)
    for a, (box, label, score) in enumerate(rows):
        out[0, :4, a] = _cxcywh(box)
        out[0, 4 + label, a] = score
    return [out]


def yolov5(rows: list[tuple[Box, int, float]], anchors: int = 20) -> list[np.ndarray]:
    out = np.zeros((1, anchors, 5 + len(LABELS)), np.float32)
    for a, (box, label, score) in enumerate(rows):
        out[0, a, :4] = _cxcywh(box)
        out[0, a, 4] = 1.0 if score > 0 else 0.0  # objectness x class score = score
        out[0, a, 5 + label] = score
    return [out]


def yolox(rows: list[tuple[Box, int, float]]) -> list[np.ndarray]:
    """Each box sits at the stride-8 cell holding its centre, encoded as the head writes it."""
    out = np.zeros((1, YOLOX_ANCHORS, 5 + len(LABELS)), np.float32)
    out[0, :, 2:4] = -20.0  # empty anchors: tiny boxes
    for box, label, score in rows:
        cx, cy, w, h = _cxcywh(box)
        col, row = int(cx // 8), int(cy // 8)
        a = row * (SIZE // 8) + col
        out[0, a, :4] = [cx / 8 - col, cy / 8 - row, math.log(w / 8), math.log(h / 8)]
        out[0, a, 4] = 1.0
        out[0, a, 5 + label] = score
    return [out]


def nms_in_graph(rows: list[tuple[Box, int, float]], slots: int = 10) -> list[np.ndarray]:
    out = np.zeros((1, slots, 6), np.float32)  # zero rows are the exporter's padding
    for k, (box, label, score) in enumerate(rows):
        out[0, k] = [*box, score, label]
    return [out]


LAYOUTS = {
    "yolov8": (yolov8, {"layout": "yolov8", "outputs": ["output0"]}),
    "yolov5": (yolov5, {"layout": "yolov5", "outputs": ["output0"]}),
    "yolox": (yolox, {"layout": "yolox", "outputs": ["output"]}),
    "nms": (nms_in_graph, {"layout": "nms", "outputs": ["detections"]}),
}
A_PIT: Box = (16.0, 8.0, 32.0, 24.0)
A_STAIN: Box = (40.0, 40.0, 56.0, 60.0)


def _boxes(out: Any) -> list[tuple[str, float, Box]]:
    return [(d.label, round(d.score, 4), tuple(round(v, 4) for v in d.box)) for d in out.detections]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_reads_the_same_two_boxes(layout: str) -> None:
    encode, post = LAYOUTS[layout]
    rows = [(A_PIT, 1, 0.9), (A_STAIN, 2, 0.6), ((0.0, 0.0, 8.0, 8.0), 0, 0.1)]  # last: too weak
    (out,) = postprocess(encode(rows), _manifest(post))
    assert _boxes(out) == [
        ("pit", 0.9, (0.25, 0.125, 0.5, 0.375)),
        ("stain", 0.6, (0.625, 0.625, 0.875, 0.9375)),
    ]
    assert out.label == "pit"
    assert out.scores == pytest.approx({"scratch": 0.0, "pit": 0.9, "stain": 0.6})


@pytest.mark.parametrize("layout", ["yolov8", "yolov5"])
def test_overlapping_boxes_of_one_label_are_suppressed_but_not_across_labels(layout: str) -> None:
    encode, post = LAYOUTS[layout]
    shifted: Box = (17.0, 8.0, 33.0, 24.0)  # IoU with A_PIT about 0.88
    rows = [(A_PIT, 1, 0.9), (shifted, 1, 0.8), (shifted, 0, 0.7)]
    (out,) = postprocess(encode(rows), _manifest({**post, "iou_threshold": 0.5}))
    assert [(d.label, round(d.score, 2)) for d in out.detections] == [
        ("pit", 0.9),
        ("scratch", 0.7),
    ]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_no_box_over_the_threshold_is_no_detection(layout: str) -> None:
    encode, post = LAYOUTS[layout]
    (out,) = postprocess(encode([]), _manifest(post))
    assert out.detections == ()
    assert out.label is None
    assert out.scores == {"scratch": 0.0, "pit": 0.0, "stain": 0.0}


@pytest.mark.parametrize("layout", ["yolov8", "yolov5", "nms"])
def test_every_anchor_a_box_is_capped_at_max_detections(layout: str) -> None:
    encode, post = LAYOUTS[layout]
    rows = [((float(i), 0.0, i + 1.0, 1.0), i % 3, 0.5 + i / 100) for i in range(40)]  # disjoint
    kw = {"anchors": 40} if layout != "nms" else {"slots": 40}
    (out,) = postprocess(encode(rows, **kw), _manifest({**post, "max_detections": 7}))
    assert len(out.detections) == 7
    assert [d.score for d in out.detections] == sorted(
        (d.score for d in out.detections), reverse=True
    )
    assert out.detections[0].score == pytest.approx(0.89)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_nan_score_is_refused_naming_the_output(layout: str) -> None:
    encode, post = LAYOUTS[layout]
    raw = encode([(A_PIT, 1, 0.9)])
    name = post["outputs"][0]
    if layout == "yolov8":
        raw[0][0, 5, 3] = np.nan
    elif layout == "nms":
        raw[0][0, 0, 4] = np.nan
    else:
        raw[0][0, 3, 6] = np.nan
    with pytest.raises(OutputError, match=rf"output '{name}' holds 1 NaN score"):
        postprocess(raw, _manifest(post))


@pytest.mark.parametrize(
    ("layout", "shape", "expected"),
    [
        ("yolov8", (1, 8, 20), r"\[N, 7, A\]"),  # 4 + 4 labels: a model of other classes
        ("yolov8", (1, 20, 7), r"\[N, 7, A\]"),  # transposed: a [N, A, 4 + C] export
        ("yolov5", (1, 20, 7), r"\[N, A, 8\]"),  # no objectness column
        ("yolox", (1, 80, 8), "has 80 anchors; grids of strides"),
        ("nms", (1, 10, 7), r"\[N, K, 6\]"),  # a batch-index column
    ],
)
def test_an_output_of_another_shape_is_refused_saying_what_was_expected(
    layout: str, shape: tuple[int, ...], expected: str
) -> None:
    _encode, post = LAYOUTS[layout]
    with pytest.raises(OutputError, match=expected):
        postprocess([np.zeros(shape, np.float32)], _manifest(post))


def test_an_nms_row_naming_a_label_the_manifest_lacks_is_refused() -> None:
    raw = nms_in_graph([(A_PIT, 5, 0.9)])
    with pytest.raises(OutputError, match="label index 5; the manifest has 3 labels"):
        postprocess(raw, _manifest(LAYOUTS["nms"][1]))


def test_normalised_coordinates_and_a_batch() -> None:
    raw = yolov8([(A_PIT, 1, 0.9)])[0]
    raw[0, :4] /= SIZE
    batch = np.concatenate([raw, np.zeros_like(raw)])
    first, second = postprocess([batch], _manifest({**LAYOUTS["yolov8"][1], "normalized": True}))
    assert _boxes(first) == [("pit", 0.9, (0.25, 0.125, 0.5, 0.375))]
    assert second.detections == ()


@pytest.mark.parametrize(
    ("layout", "outputs", "message"),
    [
        ("yolov8", ["a", "b"], r"layout 'yolov8' reads 1 output"),
        ("boxes_scores", ["boxes"], r"layout 'boxes_scores' reads 2 output"),
        ("nms", [], r"layout 'nms' reads 1 output"),
    ],
)
def test_a_layout_with_the_wrong_number_of_outputs_is_refused(
    layout: str, outputs: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _manifest({"layout": layout, "outputs": outputs})


# -- letterbox geometry ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "mode", "frame"),
    [
        ((128, 64), "stretch", Frame(128, 64, 0.5, 1.0, 0, 0)),
        ((128, 64), "letterbox", Frame(128, 64, 0.5, 0.5, 0, 16)),
        ((64, 128), "letterbox", Frame(64, 128, 0.5, 0.5, 16, 0)),
        ((32, 32), "letterbox", Frame(32, 32, 2.0, 2.0, 0, 0)),
        ((100, 33), "letterbox", Frame(100, 33, 0.64, 21 / 33, 0, 21)),  # odd pixel at the bottom
    ],
)
def test_fit(image: tuple[int, int], mode: Any, frame: Frame) -> None:
    got = fit(*image, SIZE, SIZE, mode)
    assert (got.width, got.height, got.pad_x, got.pad_y) == (
        frame.width,
        frame.height,
        frame.pad_x,
        frame.pad_y,
    )
    assert (got.scale_x, got.scale_y) == pytest.approx((frame.scale_x, frame.scale_y))


def test_a_letterboxed_box_maps_back_to_the_original_image() -> None:
    frame = fit(128, 64, SIZE, SIZE, "letterbox")  # placed 64x32 at y = 16
    inside = np.array([[0.0, 16.0, 64.0, 48.0], [16.0, 24.0, 32.0, 40.0]], np.float32)
    assert to_image(inside, frame).tolist() == [[0.0, 0.0, 1.0, 1.0], [0.25, 0.25, 0.5, 0.75]]
    in_padding = np.array([[0.0, 0.0, 64.0, 10.0]], np.float32)
    assert to_image(in_padding, frame).tolist() == [[0.0, 0.0, 1.0, 0.0]]  # clipped to the image


def test_letterbox_preprocessing_pads_with_the_pad_value_and_detections_come_back() -> None:
    manifest = _manifest(LAYOUTS["yolov8"][1], mode="letterbox")
    image = np.full((64, 128, 3), 200, np.uint8)  # 128 wide, 64 high
    tensor = preprocess(image, manifest)
    spec = manifest.preprocess
    pad = (114 * spec.scale - spec.mean[0]) / spec.std[0]
    assert tensor.shape == (1, 3, SIZE, SIZE)
    assert np.allclose(tensor[0, :, :16, :], pad)  # 16 rows of padding above ...
    assert np.allclose(tensor[0, :, 48:, :], pad)  # ... and below
    assert np.allclose(tensor[0, :, 16:48, :], (200 * spec.scale - spec.mean[0]) / spec.std[0])
    frame = frame_of(image, spec.resize)
    (out,) = postprocess(yolov8([((16.0, 24.0, 32.0, 40.0), 0, 0.8)]), manifest, [frame])
    assert _boxes(out) == [("scratch", 0.8, (0.25, 0.25, 0.5, 0.75))]


# -- anomaly maps ------------------------------------------------------------------------------


def _anomaly(**post: Any) -> ModelManifest:
    doc = copy.deepcopy(VALID)
    doc["input"]["shape"] = [1, 3, SIZE, SIZE]
    doc["preprocess"]["resize"] = {"width": SIZE, "height": SIZE}
    doc["labels"] = ["good", "anomalous"]
    doc["postprocess"] = {"kind": "anomaly", "map_output": "anomaly_map", **post}
    return ModelManifest.model_validate(doc)


def _map(*blocks: tuple[int, int, int, int, float], side: int = 32) -> np.ndarray:
    amap = np.zeros((1, 1, side, side), np.float32)
    for x, y, w, h, value in blocks:
        amap[0, 0, y : y + h, x : x + w] = value
    return amap


def test_an_anomaly_map_gives_regions_largest_first_and_the_verdict() -> None:
    amap = _map((4, 8, 4, 4, 0.9), (20, 20, 8, 6, 0.7), (0, 31, 1, 1, 0.95))  # last: one pixel
    score = np.array([[0.8]], np.float32)
    (out,) = postprocess([amap, score], _anomaly(score_output="pred_score", min_area=0.002))
    assert out.label == "anomalous"
    assert out.scores == pytest.approx({"anomalous": 0.8})
    assert [(r.box, r.area, round(r.score, 2)) for r in out.regions] == [
        ((20 / 32, 20 / 32, 28 / 32, 26 / 32), 48 / 1024, 0.7),
        ((4 / 32, 8 / 32, 8 / 32, 12 / 32), 16 / 1024, 0.9),
    ]


def test_a_clean_map_is_good_with_no_regions_and_the_map_maximum_as_its_score() -> None:
    (out,) = postprocess([_map((3, 3, 2, 2, 0.3))], _anomaly())
    assert out.label == "good"
    assert out.scores == pytest.approx({"anomalous": 0.3})
    assert out.regions == ()


def test_a_map_that_is_anomalous_everywhere_is_one_region_covering_the_image() -> None:
    (out,) = postprocess([np.ones((1, 32, 32), np.float32)], _anomaly())
    assert [(r.box, r.area) for r in out.regions] == [((0.0, 0.0, 1.0, 1.0), 1.0)]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([np.full((1, 1, 8, 8), np.nan, np.float32)], "'anomaly_map' holds 64 NaN"),
        ([np.zeros((1, 2, 8, 8), np.float32)], r"expected \[N, 1, H, W\] or \[N, H, W\]"),
        ([np.zeros((8, 8), np.float32)], r"expected \[N, 1, H, W\]"),
    ],
)
def test_an_unreadable_anomaly_map_is_refused(raw: list[np.ndarray], message: str) -> None:
    with pytest.raises(OutputError, match=message):
        postprocess(raw, _anomaly())


def test_an_anomaly_score_that_is_nan_or_for_another_batch_is_refused() -> None:
    manifest = _anomaly(score_output="pred_score")
    with pytest.raises(OutputError, match="'pred_score' holds 1 NaN"):
        postprocess([_map(), np.array([np.nan], np.float32)], manifest)
    with pytest.raises(OutputError, match="2 scores for 1 maps"):
        postprocess([_map(), np.zeros(2, np.float32)], manifest)


def test_an_anomaly_model_has_exactly_two_labels() -> None:
    doc = copy.deepcopy(VALID)
    doc["postprocess"] = {"kind": "anomaly", "map_output": "m"}
    with pytest.raises(ValueError, match="two labels, normal then anomalous"):
        ModelManifest.model_validate(doc)
