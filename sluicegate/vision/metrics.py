"""Detection quality: mean average precision at an IoU threshold, VOC style.

This module owns how a detector is scored against ground truth: per label, every predicted
box of every image, best score first, is matched to the truth box of that label in its own
image that it overlaps most; if their IoU reaches the threshold and that truth is not yet
claimed, the prediction claims it (a true positive), otherwise it is a false positive (so a
second box on one defect counts against the detector, not for it). The
label's AP is the area under its all-point interpolated precision-recall curve (precision at
each recall is the best precision at that recall or any higher, as in VOC 2010 and later);
the mean is over the labels that have ground truth. Boxes are xyxy, in any one unit (pixels
or fractions) used throughout. Pure Python and NumPy, no I/O; it never reorders or edits
what it is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Box",
    "ClassAP",
    "Prediction",
    "Score",
    "Truth",
    "average_precision",
    "iou",
    "mean_average_precision",
]

Box = tuple[float, float, float, float]  # x1, y1, x2, y2
Prediction = tuple[str, float, Box]  # label, score, box
Truth = tuple[str, Box]  # label, box


@dataclass(frozen=True)
class ClassAP:
    label: str
    ap: float | None  # None when the label has no ground truth (left out of the mean)
    truths: int
    predictions: int
    true_positives: int


@dataclass(frozen=True)
class Score:
    mean_ap: float
    per_class: tuple[ClassAP, ...]  # in the order of ``labels``, then of first appearance

    def ap(self, label: str) -> float | None:
        for c in self.per_class:
            if c.label == label:
                return c.ap
        known = ", ".join(c.label for c in self.per_class)
        raise KeyError(f"no label {label!r} in this score; known: {known}")


def iou(a: Box, b: Box) -> float:
    """Intersection over union of two xyxy boxes (0 when both are empty)."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = _area(a) + _area(b) - inter
    return inter / union if union > 0 else 0.0


def average_precision(recall: Sequence[float], precision: Sequence[float]) -> float:
    """Area under the all-point interpolated precision-recall curve; ``recall`` ascending,
    one point per prediction in score order."""
    if len(recall) != len(precision):
        raise ValueError(f"{len(recall)} recall values for {len(precision)} precision values")
    r = np.concatenate([[0.0], np.asarray(recall, np.float64), [1.0]])
    p = np.concatenate([[0.0], np.asarray(precision, np.float64), [0.0]])
    p = np.maximum.accumulate(p[::-1])[::-1]  # the envelope: best precision at >= recall
    steps = np.flatnonzero(r[1:] != r[:-1])
    return float(np.sum((r[steps + 1] - r[steps]) * p[steps + 1]))


def mean_average_precision(
    predictions: Sequence[Sequence[Prediction]],
    truths: Sequence[Sequence[Truth]],
    *,
    iou_threshold: float = 0.5,
    labels: Iterable[str] = (),
) -> Score:
    """mAP of ``predictions[i]`` against ``truths[i]``, image by image.

    ``labels`` fixes the order of the result (and adds labels that may appear in neither);
    the others follow in order of first appearance. A ValueError when no label has truth.
    """
    if len(predictions) != len(truths):
        raise ValueError(
            f"predictions cover {len(predictions)} images but truths {len(truths)}; "
            "give one (possibly empty) list per image to each"
        )
    if not 0.0 < iou_threshold <= 1.0:
        raise ValueError(f"iou_threshold must be in (0, 1], got {iou_threshold}")
    order = dict.fromkeys(labels)  # an ordered set
    for image in truths:
        order.update(dict.fromkeys(t[0] for t in image))
    for found in predictions:
        order.update(dict.fromkeys(p[0] for p in found))
    per_class = tuple(_class_ap(label, predictions, truths, iou_threshold) for label in order)
    scored = [c.ap for c in per_class if c.ap is not None]
    if not scored:
        raise ValueError("no ground truth boxes: mean average precision is undefined")
    return Score(sum(scored) / len(scored), per_class)


def _class_ap(
    label: str,
    predictions: Sequence[Sequence[Prediction]],
    truths: Sequence[Sequence[Truth]],
    iou_threshold: float,
) -> ClassAP:
    boxes = [[t[1] for t in image if t[0] == label] for image in truths]
    n_truth = sum(len(b) for b in boxes)
    ranked = [
        (score, image, box)
        for image, found in enumerate(predictions)
        for (name, score, box) in found
        if name == label
    ]
    # Best first; equal scores keep the order given (images, then their lists).
    ranked.sort(key=lambda item: -item[0])
    claimed = [[False] * len(b) for b in boxes]
    hits: list[bool] = []
    for _, image, box in ranked:
        overlaps = [iou(box, t) for t in boxes[image]]
        best = int(np.argmax(overlaps)) if overlaps else -1
        hit = best >= 0 and overlaps[best] >= iou_threshold and not claimed[image][best]
        if hit:
            claimed[image][best] = True
        hits.append(hit)
    tp = int(sum(hits))
    if n_truth == 0:
        return ClassAP(label, None, 0, len(ranked), tp)
    cum_tp = np.cumsum(hits, dtype=np.float64)
    ranks = np.arange(1, len(hits) + 1, dtype=np.float64)
    ap = average_precision(list(cum_tp / n_truth), list(cum_tp / ranks))
    return ClassAP(label, ap, n_truth, len(ranked), tp)


def _area(box: Box) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])
