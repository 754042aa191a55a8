"""Read a model's raw output tensors into labelled results, one per batch item.

Which reading applies is the manifest's ``postprocess.kind``: ``classification`` (one score
per label) or ``detection`` (boxes, per-label scores, then per-label non-maximum
suppression). Pure NumPy: no model, no image, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sluicegate.vision.manifest import (
    ClassificationPostprocess,
    DetectionPostprocess,
    ModelManifest,
)

__all__ = ["Detection", "Outputs", "nms", "postprocess"]

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Detection:
    label: str
    score: float
    # x1, y1, x2, y2 as fractions of the image's width and height, clipped to [0, 1].
    box: tuple[float, float, float, float]


@dataclass(frozen=True)
class Outputs:
    label: str | None
    scores: dict[str, float]
    detections: tuple[Detection, ...] = ()


def postprocess(raw: list[npt.NDArray[np.generic]], manifest: ModelManifest) -> list[Outputs]:
    """``raw`` holds the graph outputs named by ``manifest.output_names``, in that order."""
    post = manifest.postprocess
    expected = len(manifest.output_names)
    if len(raw) != expected:
        raise ValueError(f"expected {expected} output tensor(s), got {len(raw)}")
    if isinstance(post, ClassificationPostprocess):
        return _classification(np.asarray(raw[0], np.float32), post, manifest.labels)
    return _detection(
        np.asarray(raw[0], np.float32),
        np.asarray(raw[1], np.float32),
        post,
        manifest.labels,
        (manifest.input.width, manifest.input.height),
    )


def _classification(
    scores: F32, post: ClassificationPostprocess, labels: tuple[str, ...]
) -> list[Outputs]:
    if scores.ndim != 2 or scores.shape[1] != len(labels):
        raise ValueError(
            f"output {post.output!r} has shape {scores.shape}; expected [N, {len(labels)}]"
        )
    if post.softmax:
        shifted = np.exp(scores - scores.max(axis=1, keepdims=True))
        scores = shifted / shifted.sum(axis=1, keepdims=True)
    best = scores.argmax(axis=1)
    return [
        Outputs(
            label=labels[int(best[i])],
            scores={label: float(v) for label, v in zip(labels, row, strict=True)},
        )
        for i, row in enumerate(scores)
    ]


def _detection(
    boxes: F32,
    scores: F32,
    post: DetectionPostprocess,
    labels: tuple[str, ...],
    input_size: tuple[int, int],
) -> list[Outputs]:
    n_labels = len(labels)
    if boxes.ndim != 3 or boxes.shape[2] != 4:
        raise ValueError(
            f"output {post.boxes_output!r} has shape {boxes.shape}; expected [N, K, 4]"
        )
    if scores.shape != (*boxes.shape[:2], n_labels):
        raise ValueError(
            f"output {post.scores_output!r} has shape {scores.shape}; "
            f"expected {[*boxes.shape[:2], n_labels]}"
        )
    if post.box_format == "cxcywh":
        centre, half = boxes[..., :2], boxes[..., 2:] * np.float32(0.5)
        boxes = np.concatenate([centre - half, centre + half], axis=-1)
    if not post.normalized:
        width, height = input_size
        boxes = boxes * np.array([1 / width, 1 / height, 1 / width, 1 / height], np.float32)
    boxes = np.clip(boxes, np.float32(0.0), np.float32(1.0))

    results = []
    for item_boxes, item_scores in zip(boxes, scores, strict=True):
        found: list[Detection] = []
        for c, label in enumerate(labels):
            candidates = np.flatnonzero(item_scores[:, c] >= post.score_threshold)
            if candidates.size == 0:
                continue
            keep = nms(item_boxes[candidates], item_scores[candidates, c], post.iou_threshold)
            for k in candidates[keep]:
                x1, y1, x2, y2 = (float(v) for v in item_boxes[k])
                found.append(Detection(label, float(item_scores[k, c]), (x1, y1, x2, y2)))
        found.sort(key=lambda d: d.score, reverse=True)
        kept = tuple(found[: post.max_detections])
        best = dict.fromkeys(labels, 0.0)
        for det in kept:
            best[det.label] = max(best[det.label], det.score)
        results.append(Outputs(label=kept[0].label if kept else None, scores=best, detections=kept))
    return results


def nms(boxes: F32, scores: F32, iou_threshold: float) -> npt.NDArray[np.intp]:
    """Indices of the boxes (xyxy) kept by greedy non-maximum suppression, best first."""
    order = np.argsort(-scores, kind="stable")
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    areas = np.maximum(x2 - x1, 0) * np.maximum(y2 - y1, 0)
    keep: list[int] = []
    while order.size:
        i = int(order[0])
        keep.append(i)
        rest = order[1:]
        w = np.maximum(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]), 0)
        h = np.maximum(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]), 0)
        inter = w * h
        union = areas[i] + areas[rest] - inter
        iou = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
        order = rest[iou <= iou_threshold]
    return np.array(keep, dtype=np.intp)
