"""Anomaly maps (anomalib-style) read into an image verdict and the regions that made it.

A model of this kind outputs a map of per-pixel anomaly scores over its input and, often,
one score for the whole image. Pixels at or over ``pixel_threshold`` form regions (OpenCV's
8-connected components); each region is reported with its box and area as fractions of the
original image and the highest score in it, largest first. The image is anomalous when its
score (the graph's, else the map's maximum) reaches ``image_threshold``. A NaN in the map or
the score is an :class:`~sluicegate.errors.OutputError`. Pure NumPy and OpenCV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np
import numpy.typing as npt

from sluicegate.errors import OutputError
from sluicegate.vision.geometry import Frame, to_image
from sluicegate.vision.manifest import AnomalyPostprocess

__all__ = ["Region", "Verdict", "read_maps"]

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Region:
    """A connected area of anomalous pixels."""

    score: float  # the highest pixel score in it
    box: tuple[float, float, float, float]  # xyxy, fractions of the image
    area: float  # fraction of the image's area


@dataclass(frozen=True)
class Verdict:
    score: float
    anomalous: bool
    regions: tuple[Region, ...]


def read_maps(
    raw: Sequence[npt.NDArray[np.generic]],
    post: AnomalyPostprocess,
    input_size: tuple[int, int],
    frames: Sequence[Frame],
) -> list[Verdict]:
    """One verdict per image of the batch."""
    maps = np.asarray(raw[0], np.float32)
    if maps.ndim == 4 and maps.shape[1] == 1:
        maps = maps[:, 0]
    if maps.ndim != 3:
        raise OutputError(
            f"output {post.map_output!r} has shape {list(np.shape(raw[0]))}; "
            "expected [N, 1, H, W] or [N, H, W]"
        )
    _no_nan(post.map_output, maps)
    if post.score_output is not None:
        scores = np.asarray(raw[1], np.float32).reshape(-1)
        if scores.shape[0] != maps.shape[0]:
            raise OutputError(
                f"output {post.score_output!r} has {scores.shape[0]} scores for "
                f"{maps.shape[0]} maps"
            )
        _no_nan(post.score_output, scores)
    else:
        scores = maps.reshape(maps.shape[0], -1).max(axis=1)
    if maps.shape[0] != len(frames):
        raise OutputError(f"the model answered {maps.shape[0]} images for {len(frames)}")
    return [
        Verdict(
            float(score),
            bool(score >= post.image_threshold),
            _regions(amap, post, input_size, frame),
        )
        for amap, score, frame in zip(maps, scores, frames, strict=True)
    ]


def _regions(
    amap: F32, post: AnomalyPostprocess, input_size: tuple[int, int], frame: Frame
) -> tuple[Region, ...]:
    mask = (amap >= post.pixel_threshold).astype(np.uint8)
    count, labels, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
    map_h, map_w = amap.shape
    # Map pixels to input pixels, then to the original image.
    to_input = np.array([input_size[0] / map_w, input_size[1] / map_h] * 2, np.float32)
    image_px = frame.width * frame.height
    px_area = (input_size[0] / map_w) * (input_size[1] / map_h) / (frame.scale_x * frame.scale_y)
    found: list[Region] = []
    order = sorted(range(1, count), key=lambda i: -int(stats[i, cv2.CC_STAT_AREA]))
    for i in order:
        area = float(stats[i, cv2.CC_STAT_AREA]) * px_area / image_px
        if area < post.min_area:
            continue
        x, y = stats[i, cv2.CC_STAT_LEFT], stats[i, cv2.CC_STAT_TOP]
        w, h = stats[i, cv2.CC_STAT_WIDTH], stats[i, cv2.CC_STAT_HEIGHT]
        box = np.array([[x, y, x + w, y + h]], np.float32) * to_input
        x1, y1, x2, y2 = (float(v) for v in to_image(box, frame)[0])
        peak = float(amap[labels == i].max())
        found.append(Region(peak, (x1, y1, x2, y2), min(area, 1.0)))
        if len(found) == post.max_regions:
            break
    return tuple(found)


def _no_nan(name: str, values: F32) -> None:
    nan = int(np.isnan(values).sum())
    if nan:
        raise OutputError(
            f"output {name!r} holds {nan} NaN value(s) of {values.size}: the model's answer "
            "cannot be read"
        )
