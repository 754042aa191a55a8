"""Detector outputs, in the layouts real exporters write, read into boxes on the image.

Each layout (``DetectionPostprocess.layout``) is first brought to one shape of candidates:
xyxy boxes in model-input pixels and a score per label. Then, per label, scores under the
threshold go, non-maximum suppression keeps the best of overlapping boxes (not for ``nms``,
whose graph did it), and the boxes are mapped back to fractions of the original image
through its :class:`~sluicegate.vision.geometry.Frame`. An output of the wrong shape, or
with a NaN score, is an :class:`~sluicegate.errors.OutputError` naming the tensor: the
job's result is ``failed`` with that reason, never a made-up box. Pure NumPy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sluicegate.errors import OutputError
from sluicegate.vision.geometry import Frame, to_image
from sluicegate.vision.manifest import DetectionPostprocess

__all__ = ["MAX_CANDIDATES", "Detection", "candidates", "detect", "nms"]

F32 = npt.NDArray[np.float32]
MAX_CANDIDATES = 3000  # per label, best first, before suppression


@dataclass(frozen=True)
class Detection:
    label: str
    score: float
    # x1, y1, x2, y2 as fractions of the image's width and height, clipped to [0, 1].
    box: tuple[float, float, float, float]


@dataclass(frozen=True)
class Candidates:
    """One image's candidate boxes (xyxy, model-input pixels) and per-label scores;
    ``suppressed`` when the graph already ran NMS."""

    boxes: F32  # [K, 4]
    scores: F32  # [K, C]
    suppressed: bool = False


def detect(
    raw: Sequence[npt.NDArray[np.generic]],
    post: DetectionPostprocess,
    labels: tuple[str, ...],
    input_size: tuple[int, int],
    frames: Sequence[Frame],
) -> list[tuple[Detection, ...]]:
    """The detections of each image of the batch, best first."""
    found = candidates(raw, post, len(labels), input_size)
    if len(found) != len(frames):
        raise OutputError(f"the model answered {len(found)} images for {len(frames)}")
    return [_pick(c, post, labels, frame) for c, frame in zip(found, frames, strict=True)]


def candidates(
    raw: Sequence[npt.NDArray[np.generic]],
    post: DetectionPostprocess,
    n_labels: int,
    input_size: tuple[int, int],
) -> list[Candidates]:
    """Each image's candidates, whatever the layout."""
    names = post.tensor_names
    tensors = [np.asarray(t, np.float32) for t in raw]
    for name, tensor in zip(names, tensors, strict=True):
        _finite_scores(name, tensor, post)
    width, height = input_size
    px = np.array([width, height, width, height], np.float32)
    layout = post.layout
    if layout == "boxes_scores":
        boxes, scores = tensors
        _shape(names[0], boxes, (None, None, 4), "[N, K, 4]")
        _shape(names[1], scores, (boxes.shape[0], boxes.shape[1], n_labels), f"[N, K, {n_labels}]")
        if post.box_format == "cxcywh":
            boxes = _xyxy(boxes)
        if post.normalized:
            boxes = boxes * px
        return [Candidates(b, s) for b, s in zip(boxes, scores, strict=True)]
    (out,) = tensors
    if layout == "yolov8":
        _shape(names[0], out, (None, 4 + n_labels, None), f"[N, {4 + n_labels}, A]")
        rows = out.transpose(0, 2, 1)
        boxes, scores = _xyxy(rows[..., :4]), rows[..., 4:]
    elif layout in ("yolov5", "yolox"):
        _shape(names[0], out, (None, None, 5 + n_labels), f"[N, A, {5 + n_labels}]")
        xywh = (
            _grid_decode(names[0], out[..., :4], post.strides, input_size)
            if (layout == "yolox")
            else out[..., :4]
        )
        boxes, scores = _xyxy(xywh), out[..., 4:5] * out[..., 5:]
    else:  # nms: x1 y1 x2 y2 score label
        _shape(names[0], out, (None, None, 6), "[N, K, 6]")
        return [
            _suppressed(names[0], rows, n_labels, px if post.normalized else None) for rows in out
        ]
    if post.normalized:
        boxes = boxes * px
    return [Candidates(b, s) for b, s in zip(boxes, scores, strict=True)]


def _pick(
    found: Candidates, post: DetectionPostprocess, labels: tuple[str, ...], frame: Frame
) -> tuple[Detection, ...]:
    picked: list[tuple[int, int]] = []  # (candidate, label)
    for c in range(len(labels)):
        score = found.scores[:, c]
        above = np.flatnonzero(score >= post.score_threshold)
        if above.size == 0:
            continue
        above = above[np.argsort(-score[above], kind="stable")[:MAX_CANDIDATES]]
        if found.suppressed:
            keep = above
        else:
            keep = above[nms(found.boxes[above], score[above], post.iou_threshold)]
        picked += [(int(k), c) for k in keep]
    picked.sort(key=lambda kc: -float(found.scores[kc]))
    picked = picked[: post.max_detections]
    if not picked:
        return ()
    boxes = found.boxes[[k for k, _ in picked]]
    if not np.isfinite(boxes).all():
        raise OutputError("the model gave a box that is not a finite number")
    placed = to_image(boxes, frame)
    return tuple(
        Detection(labels[c], float(found.scores[k, c]), _four(box))
        for (k, c), box in zip(picked, placed, strict=True)
    )


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


def _suppressed(name: str, rows: F32, n_labels: int, px: F32 | None) -> Candidates:
    live = rows[rows[:, 4] > 0]  # exporters pad with zero rows
    index = live[:, 5]
    bad = (index < 0) | (index >= n_labels) | (index != np.round(index))
    if bad.any():
        raise OutputError(
            f"output {name!r} names label index {float(index[bad][0]):g}; the manifest has "
            f"{n_labels} labels (0 to {n_labels - 1})"
        )
    scores = np.zeros((live.shape[0], n_labels), np.float32)
    scores[np.arange(live.shape[0]), index.astype(np.intp)] = live[:, 4]
    boxes = live[:, :4] * px if px is not None else live[:, :4]
    return Candidates(np.ascontiguousarray(boxes), scores, suppressed=True)


def _grid_decode(name: str, raw: F32, strides: tuple[int, ...], input_size: tuple[int, int]) -> F32:
    """YOLOX's head output to cx cy w h in input pixels: the cell plus its offset, the
    exponent of the log size, each times the grid's stride."""
    width, height = input_size
    cells, steps = [], []
    for stride in strides:
        ys, xs = np.meshgrid(np.arange(height // stride), np.arange(width // stride), indexing="ij")
        cells.append(np.stack([xs, ys], axis=-1).reshape(-1, 2))
        steps.append(np.full((cells[-1].shape[0], 1), stride))
    grid = np.concatenate(cells).astype(np.float32)
    stride_col = np.concatenate(steps).astype(np.float32)
    if raw.shape[1] != grid.shape[0]:
        raise OutputError(
            f"output {name!r} has {raw.shape[1]} anchors; grids of strides "
            f"{list(strides)} on a {width}x{height} input have {grid.shape[0]}"
        )
    with np.errstate(over="ignore"):
        size = np.exp(raw[..., 2:4]) * stride_col
    return np.concatenate([(raw[..., :2] + grid) * stride_col, size], axis=-1)


def _xyxy(cxcywh: F32) -> F32:
    centre, half = cxcywh[..., :2], cxcywh[..., 2:4] * np.float32(0.5)
    return np.concatenate([centre - half, centre + half], axis=-1)


def _finite_scores(name: str, tensor: F32, post: DetectionPostprocess) -> None:
    """A NaN anywhere a score is read makes the whole answer unreadable."""
    if post.layout == "boxes_scores":
        scores = tensor if name == post.tensor_names[1] else None
    elif post.layout == "yolov8":
        scores = tensor[:, 4:, :] if tensor.ndim == 3 else tensor
    elif post.layout == "nms":
        scores = tensor[..., 4:] if tensor.ndim == 3 else tensor
    else:
        scores = tensor[..., 4:] if tensor.ndim == 3 else tensor
    if scores is not None:
        nan = int(np.isnan(scores).sum())
        if nan:
            raise OutputError(
                f"output {name!r} holds {nan} NaN score(s) of {scores.size}: the model's "
                "answer cannot be read (a broken export, or an input it cannot take)"
            )


def _shape(name: str, tensor: F32, want: tuple[int | None, ...], spelt: str) -> None:
    if tensor.ndim != len(want) or any(
        w is not None and got != w for got, w in zip(tensor.shape, want, strict=True)
    ):
        raise OutputError(f"output {name!r} has shape {list(tensor.shape)}; expected {spelt}")


def _four(box: F32) -> tuple[float, float, float, float]:
    x1, y1, x2, y2 = (float(v) for v in box)
    return x1, y1, x2, y2
