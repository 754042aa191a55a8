"""mAP@0.5 (sluicegate.vision.metrics): hand-worked tables of hits, misses and duplicates."""

from __future__ import annotations

import pytest

from sluicegate.vision.metrics import (
    Box,
    Prediction,
    Truth,
    average_precision,
    iou,
    mean_average_precision,
)

A: Box = (0.0, 0.0, 10.0, 10.0)
B: Box = (20.0, 20.0, 30.0, 40.0)
C: Box = (50.0, 0.0, 60.0, 5.0)
NEAR_A: Box = (1.0, 0.0, 11.0, 10.0)  # IoU with A 9/11
HALF_A: Box = (0.0, 0.0, 20.0, 10.0)  # IoU with A exactly 1/2
OFF_A: Box = (0.0, 0.0, 21.0, 10.0)  # IoU with A just under 1/2
NOWHERE: Box = (80.0, 80.0, 90.0, 90.0)


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [
        (A, A, 1.0),
        (A, NEAR_A, 9 / 11),
        (A, HALF_A, 0.5),
        (A, B, 0.0),
        ((0.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0), 0.0),
        ((0.0, 0.0, 2.0, 2.0), (1.0, 1.0, 3.0, 3.0), 1 / 7),
    ],
)
def test_iou(a: Box, b: Box, want: float) -> None:
    assert iou(a, b) == pytest.approx(want)
    assert iou(b, a) == pytest.approx(want)


# Each case: predictions per image, truths per image, mAP, per-label AP.
CASES: list[
    tuple[str, list[list[Prediction]], list[list[Truth]], float, dict[str, float | None]]
] = [
    (
        "perfect",
        [[("pit", 0.9, A), ("stain", 0.8, B)], [("pit", 0.7, C)]],
        [[("pit", A), ("stain", B)], [("pit", C)]],
        1.0,
        {"pit": 1.0, "stain": 1.0},
    ),
    (
        "near enough is a hit",
        [[("pit", 0.9, NEAR_A)]],
        [[("pit", A)]],
        1.0,
        {"pit": 1.0},
    ),
    (
        "IoU of exactly 0.5 is a hit",
        [[("pit", 0.9, HALF_A)]],
        [[("pit", A)]],
        1.0,
        {"pit": 1.0},
    ),
    (
        "IoU under 0.5 is a false positive and a miss",
        [[("pit", 0.9, OFF_A)]],
        [[("pit", A)]],
        0.0,
        {"pit": 0.0},
    ),
    (
        "one of two missed: recall stops at 1/2",
        [[("pit", 0.9, A)], []],
        [[("pit", A)], [("pit", C)]],
        0.5,
        {"pit": 0.5},
    ),
    (
        "nothing predicted",
        [[], []],
        [[("pit", A)], [("pit", C)]],
        0.0,
        {"pit": 0.0},
    ),
    (
        "false positive ranked first halves the precision",
        [[("pit", 0.9, NOWHERE), ("pit", 0.5, A)]],
        [[("pit", A)]],
        0.5,
        {"pit": 0.5},
    ),
    (
        "false positive ranked last costs nothing",
        [[("pit", 0.9, A), ("pit", 0.5, NOWHERE)]],
        [[("pit", A)]],
        1.0,
        {"pit": 1.0},
    ),
    (
        "duplicate counted once: TP, FP, TP over 2 truths",
        [[("pit", 0.9, A), ("pit", 0.8, NEAR_A), ("pit", 0.7, B)]],
        [[("pit", A), ("pit", B)]],
        0.5 + 0.5 * 2 / 3,
        {"pit": 0.5 + 0.5 * 2 / 3},
    ),
    (
        "the better-scored duplicate claims the truth, even if it overlaps less",
        [[("pit", 0.6, A), ("pit", 0.9, NEAR_A)]],
        [[("pit", A)]],
        1.0,
        {"pit": 1.0},
    ),
    (
        "interpolation: FP, TP, TP takes the best precision to the right",
        [[("pit", 0.9, NOWHERE), ("pit", 0.8, A), ("pit", 0.7, B)]],
        [[("pit", A), ("pit", B)]],
        2 / 3,
        {"pit": 2 / 3},
    ),
    (
        "a box does not match a truth in another image",
        [[("pit", 0.9, C)], [("pit", 0.8, A)]],
        [[("pit", A)], [("pit", C)]],
        0.0,
        {"pit": 0.0},
    ),
    (
        "the right box with the wrong label: a miss for one, a false positive for the other",
        [[("stain", 0.9, A)]],
        [[("pit", A)]],
        0.0,
        {"pit": 0.0, "stain": None},
    ),
    (
        "per-class averaging: one label perfect, the other missed",
        [[("pit", 0.9, A)]],
        [[("pit", A), ("scratch", B)]],
        0.5,
        {"pit": 1.0, "scratch": 0.0},
    ),
    (
        "classes weigh the same whatever their counts",
        [[("pit", 0.9, A), ("pit", 0.8, C)], [("scratch", 0.9, B)], []],
        [[("pit", A), ("pit", C)], [("scratch", B)], [("scratch", A)]],
        (1.0 + 0.5) / 2,
        {"pit": 1.0, "scratch": 0.5},
    ),
]


@pytest.mark.parametrize(
    ("predictions", "truths", "want", "per_class"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_mean_average_precision(
    predictions: list[list[Prediction]],
    truths: list[list[Truth]],
    want: float,
    per_class: dict[str, float | None],
) -> None:
    score = mean_average_precision(predictions, truths)
    assert score.mean_ap == pytest.approx(want)
    got = {c.label: c.ap for c in score.per_class}
    assert got.keys() == per_class.keys()
    for label, ap in per_class.items():
        assert got[label] == (None if ap is None else pytest.approx(ap)), label


def test_counts_and_label_order() -> None:
    score = mean_average_precision(
        [[("pit", 0.9, A), ("pit", 0.8, NEAR_A)]],
        [[("pit", A), ("stain", B)]],
        labels=["scratch", "stain", "pit"],
    )
    assert [c.label for c in score.per_class] == ["scratch", "stain", "pit"]
    pit = score.per_class[2]
    assert (pit.truths, pit.predictions, pit.true_positives) == (1, 2, 1)
    assert score.ap("scratch") is None  # no truth: left out of the mean
    assert score.mean_ap == pytest.approx((1.0 + 0.0) / 2)
    with pytest.raises(KeyError, match="no label 'dent'"):
        score.ap("dent")


def test_a_stricter_threshold_turns_a_hit_into_a_miss() -> None:
    predictions: list[list[Prediction]] = [[("pit", 0.9, NEAR_A)]]
    truths: list[list[Truth]] = [[("pit", A)]]
    assert mean_average_precision(predictions, truths, iou_threshold=0.8).mean_ap == 1.0
    assert mean_average_precision(predictions, truths, iou_threshold=0.85).mean_ap == 0.0


@pytest.mark.parametrize(
    ("recall", "precision", "want"),
    [
        ([], [], 0.0),
        ([1.0], [1.0], 1.0),
        ([0.5, 1.0], [1.0, 0.5], 0.5 + 0.25),
        ([0.0, 0.5, 1.0], [0.0, 0.5, 2 / 3], 2 / 3),
        ([0.25, 0.25, 0.5], [1.0, 0.5, 2 / 3], 0.25 + 0.25 * 2 / 3),
    ],
)
def test_average_precision(recall: list[float], precision: list[float], want: float) -> None:
    assert average_precision(recall, precision) == pytest.approx(want)


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="predictions cover 1 images but truths 2"):
        mean_average_precision([[]], [[], []])
    with pytest.raises(ValueError, match="no ground truth"):
        mean_average_precision([[("pit", 0.9, A)]], [[]])
    with pytest.raises(ValueError, match="iou_threshold"):
        mean_average_precision([[]], [[("pit", A)]], iou_threshold=0.0)
    with pytest.raises(ValueError, match="2 recall values for 1"):
        average_precision([0.5, 1.0], [1.0])
