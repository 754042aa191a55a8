"""Reading text: the pure steps of a two-stage OCR pipeline (PP-OCR's detector and
recogniser), between the two ONNX sessions that :mod:`sluicegate.vision.ocr_model` runs.

1. :func:`detector_size` picks the detector's input size (sides multiples of 32, the longer
   at most ``max_side``, the shorter at least ``min_side``).
2. :func:`text_boxes` is the DB postprocess (Differentiable Binarization): the text
   probability map binarized and slightly dilated, each blob's minimum-area rectangle kept
   if it is large enough and its mean probability high enough, then grown by
   ``area x unclip_ratio / perimeter`` on each side (the detector is trained on shrunk
   text regions), in the original image's pixels, in reading order.
3. :func:`crop` warps each quadrilateral upright; :func:`recogniser_batch` scales the crops
   to the recogniser's height and pads them to one width.
4. :func:`ctc_greedy` reads the recogniser's per-step class probabilities: best class per
   step, repeats merged, blanks dropped, the confidence the mean of the kept steps.

NumPy and OpenCV only; no model, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np
import numpy.typing as npt

__all__ = [
    "TextLine",
    "crop",
    "ctc_greedy",
    "detector_size",
    "recogniser_batch",
    "text_boxes",
]

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]
Quad = F32  # [4, 2]: top-left, top-right, bottom-right, bottom-left, (x, y) pixels
Rect = tuple[tuple[float, float], tuple[float, float], float]  # OpenCV: centre, size, angle


@dataclass(frozen=True)
class TextLine:
    text: str
    score: float  # the recogniser's confidence
    box: tuple[float, float, float, float]  # xyxy fractions of the image
    quad: tuple[tuple[float, float], ...]  # the four corners, fractions of the image


def detector_size(width: int, height: int, *, max_side: int, min_side: int) -> tuple[int, int]:
    """The detector input (width, height) for an image: scaled down so the longer side is at
    most ``max_side``, up so the shorter is at least ``min_side`` (which wins where both
    cannot hold: a long strip), sides rounded to 32."""
    ratio = 1.0
    if max(width, height) > max_side:
        ratio = max_side / max(width, height)
    if min(width, height) * ratio < min_side:
        ratio = min_side / min(width, height)
    return (max(32, round(width * ratio / 32) * 32), max(32, round(height * ratio / 32) * 32))


def text_boxes(
    prob: F32,
    image_size: tuple[int, int],
    *,
    threshold: float = 0.3,
    box_threshold: float = 0.5,
    unclip_ratio: float = 1.6,
    max_candidates: int = 1000,
    min_size: float = 3.0,
) -> list[tuple[Quad, float]]:
    """Text quadrilaterals in the original image's pixels (``image_size`` is its width,
    height) from the detector's ``[H, W]`` probability map, with their mean probability,
    in reading order."""
    height, width = prob.shape
    mask = cv2.dilate((prob > threshold).astype(np.uint8), np.ones((2, 2), np.uint8))
    contours, _ = cv2.findContours(mask, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
    to_image = np.array([image_size[0] / width, image_size[1] / height], np.float32)
    found: list[tuple[Quad, float]] = []
    for contour in contours[:max_candidates]:
        (cx, cy), (rw, rh), angle = cv2.minAreaRect(contour)
        rect: Rect = ((cx, cy), (rw, rh), angle)
        if min(rect[1]) < min_size:
            continue
        score = _mean_inside(prob, _corners(rect))
        if score < box_threshold:
            continue
        grown = _unclip(rect, unclip_ratio)
        if min(grown[1]) < min_size + 2:
            continue
        quad = _corners(grown) * to_image
        quad[:, 0] = np.clip(np.round(quad[:, 0]), 0, image_size[0])
        quad[:, 1] = np.clip(np.round(quad[:, 1]), 0, image_size[1])
        found.append((quad, score))
    return _reading_order(found)


def crop(image: U8, quad: Quad) -> U8:
    """The quadrilateral's contents warped to an upright rectangle; a crop at least 1.5
    times taller than wide is turned a quarter (vertical text becomes a line)."""
    top = np.linalg.norm(quad[0] - quad[1])
    bottom = np.linalg.norm(quad[3] - quad[2])
    left = np.linalg.norm(quad[0] - quad[3])
    right = np.linalg.norm(quad[1] - quad[2])
    w, h = max(1, int(max(top, bottom))), max(1, int(max(left, right)))
    target = np.array([[0, 0], [w, 0], [w, h], [0, h]], np.float32)
    warp = cv2.getPerspectiveTransform(quad.astype(np.float32), target)
    out = cv2.warpPerspective(
        image, warp, (w, h), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC
    )
    if h / w >= 1.5:
        out = np.rot90(out)
    return np.ascontiguousarray(out, np.uint8)


def recogniser_batch(crops: Sequence[U8], *, height: int, min_width: int) -> F32:
    """Crops as one ``[N, 3, height, W]`` batch: each scaled to ``height`` keeping its
    aspect ratio, normalised to ``[-1, 1]`` and padded on the right with zeros to the widest
    (at least ``min_width``)."""
    ratios = [c.shape[1] / max(1, c.shape[0]) for c in crops]
    width = max([min_width, *(math.ceil(height * r) for r in ratios)])
    batch = np.zeros((len(crops), 3, height, width), np.float32)
    for i, (piece, ratio) in enumerate(zip(crops, ratios, strict=True)):
        w = min(width, max(1, math.ceil(height * ratio)))
        scaled = cv2.resize(piece, (w, height), interpolation=cv2.INTER_LINEAR)
        batch[i, :, :, :w] = (scaled.astype(np.float32).transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    return batch


def ctc_greedy(probs: F32, charset: Sequence[str]) -> list[tuple[str, float]]:
    """``[N, T, C]`` probabilities to text: class 0 is CTC's blank, class i the
    ``charset[i - 1]``. Returns (text, mean probability of its characters) per item."""
    if probs.ndim != 3 or probs.shape[2] != len(charset) + 1:
        raise ValueError(
            f"recogniser output has shape {list(probs.shape)}; expected [N, T, "
            f"{len(charset) + 1}] (blank + {len(charset)} characters)"
        )
    best = probs.argmax(axis=2)
    peak = probs.max(axis=2)
    out = []
    for classes, confidence in zip(best, peak, strict=True):
        keep = classes != 0
        keep[1:] &= classes[1:] != classes[:-1]
        text = "".join(charset[c - 1] for c in classes[keep])
        out.append((text, float(confidence[keep].mean()) if keep.any() else 0.0))
    return out


def _corners(rect: Rect) -> Quad:
    """A rotated rectangle's corners: top-left, top-right, bottom-right, bottom-left."""
    points = sorted(cv2.boxPoints(rect).tolist(), key=lambda p: p[0])
    left = sorted(points[:2], key=lambda p: p[1])
    right = sorted(points[2:], key=lambda p: p[1])
    return np.array([left[0], right[0], right[1], left[1]], np.float32)


def _unclip(rect: Rect, ratio: float) -> Rect:
    """The rectangle grown by ``area x ratio / perimeter`` on every side (the rounded offset
    of a rectangle has the grown rectangle as its minimum-area box)."""
    centre, (w, h), angle = rect
    grow = w * h * ratio / (2 * (w + h)) if w + h > 0 else 0.0
    return centre, (w + 2 * grow, h + 2 * grow), angle


def _mean_inside(prob: F32, quad: Quad) -> float:
    height, width = prob.shape
    x0 = int(np.clip(np.floor(quad[:, 0].min()), 0, width - 1))
    x1 = int(np.clip(np.ceil(quad[:, 0].max()), 0, width - 1))
    y0 = int(np.clip(np.floor(quad[:, 1].min()), 0, height - 1))
    y1 = int(np.clip(np.ceil(quad[:, 1].max()), 0, height - 1))
    inside = np.zeros((y1 - y0 + 1, x1 - x0 + 1), np.uint8)
    corners = (quad - np.array([x0, y0], np.float32)).round().astype(np.int32)
    cv2.fillPoly(inside, [corners], 1)
    return float(cv2.mean(prob[y0 : y1 + 1, x0 : x1 + 1], inside)[0])


def _reading_order(found: list[tuple[Quad, float]]) -> list[tuple[Quad, float]]:
    """Top to bottom; boxes whose tops are within 10 pixels are one line, left to right."""
    found = sorted(found, key=lambda qs: (float(qs[0][0, 1]), float(qs[0][0, 0])))
    for i in range(len(found) - 1):
        for j in range(i, -1, -1):
            a, b = found[j][0][0], found[j + 1][0][0]
            if abs(float(b[1] - a[1])) < 10 and float(b[0]) < float(a[0]):
                found[j], found[j + 1] = found[j + 1], found[j]
            else:
                break
    return found
