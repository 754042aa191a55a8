"""Synthetic surface images with 0 to 3 located defects, for training and scoring detectors.

This module owns the generator behind ``models/surface-det``: the background (surface kind,
brushing, die grid, illumination, sensor noise) is :mod:`sluicegate.vision.synth`'s, and on
it go up to three defects (a scratch, a pit cluster or a stain each), every one returned with
its label and its tight xyxy box in image pixels. A box is where the defect's own mask is
strong (half its peak for scratches and pits, 30 % for the soft stains), grown about its
centre to at least ``MIN_SIDE * scale`` on each axis: IoU means nothing for a box one pixel
thin. Defects never touch one another, so each box is one unambiguous object. Everything
is drawn from the ``numpy.random.Generator`` passed in; it must never read global random
state, and never import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np
import numpy.typing as npt

from sluicegate.vision import synth
from sluicegate.vision.synth import SURFACES, _illumination, _noise, _surface

__all__ = ["LABELS", "MAX_DEFECTS", "MIN_SIDE", "SURFACES", "Defect", "Scene", "generate", "scene"]

LABELS: tuple[str, ...] = ("scratch", "pit", "stain")
MAX_DEFECTS = 3
MIN_SIDE = 16.0  # pixels at 640x480; scaled with the image like the defects themselves

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]
Box = tuple[float, float, float, float]

_TRIES = 12  # placements tried per defect before it is left out
_MAX_IOU = 0.2  # boxes may overlap (a pit inside a diagonal scratch's box) but not coincide
_EDGE = 0.05  # mask level at which a defect counts as present, for the "no touching" rule


@dataclass(frozen=True)
class Defect:
    label: str
    box: Box  # x1, y1, x2, y2 in image pixels, x2 and y2 exclusive


@dataclass(frozen=True)
class Scene:
    image: U8  # BGR
    defects: tuple[Defect, ...]
    surface: str  # one of SURFACES: "wafer", or a metal part's


def generate(
    rng: np.random.Generator,
    *,
    width: int = 320,
    height: int = 240,
    count: int | None = None,
) -> tuple[U8, tuple[Defect, ...]]:
    """A BGR uint8 image and its defects (``count`` of them, 0 to 3, random when None).

    A defect that cannot be placed without touching another is left out, so an image may
    hold fewer than ``count``; the returned tuple is always the truth for the image.
    """
    drawn = scene(rng, width=width, height=height, count=count)
    return drawn.image, drawn.defects


def scene(
    rng: np.random.Generator,
    *,
    width: int = 320,
    height: int = 240,
    count: int | None = None,
) -> Scene:
    """:func:`generate`'s image and defects, and the kind of surface they are on (the same
    draws from ``rng``: the same image for the same state)."""
    if count is None:
        count = int(rng.integers(0, MAX_DEFECTS + 1))
    elif not 0 <= count <= MAX_DEFECTS:
        raise ValueError(f"count must be 0 to {MAX_DEFECTS}, got {count}")
    if width < 64 or height < 64:
        raise ValueError(f"image must be at least 64x64, got {width}x{height}")
    scale = math.sqrt(width * height / (640 * 480))

    surface, kind = _surface(rng, height, width, scale)
    taken = np.zeros((height, width), bool)
    defects: list[Defect] = []
    for _ in range(count):
        label = LABELS[int(rng.integers(len(LABELS)))]
        for _ in range(_TRIES):
            mask, level, colour = _draw(rng, label, height, width, scale)
            box = _box(mask, level, scale)
            present = mask >= _EDGE
            if box is None or (present & taken).any():
                continue
            if any(_iou(box, d.box) > _MAX_IOU for d in defects):
                continue
            for c in range(3):
                surface[..., c] += mask * np.float32(colour[c])
            taken |= _grow(present, max(2, round(4 * scale)))
            defects.append(Defect(label, box))
            break

    surface *= _illumination(rng, height, width)[..., None]
    surface += _noise(rng, surface.shape) * np.float32(rng.uniform(4.0, 5.5))
    return Scene(np.clip(surface, 0, 255).astype(np.uint8), tuple(defects), kind)


encode_jpeg = synth.encode_jpeg
encode_png = synth.encode_png


# --- one defect: its mask (peak 1), the level its box is cut at, its colour -----------------


def _draw(
    rng: np.random.Generator, label: str, h: int, w: int, scale: float
) -> tuple[F32, float, npt.NDArray[np.float64]]:
    if label == "scratch":
        mask, contrast = _scratch(rng, h, w, scale)
        return mask, 0.5, np.full(3, contrast)
    if label == "pit":
        mask, contrast = _pits(rng, h, w, scale)
        return mask, 0.5, np.full(3, contrast)
    mask, colour = _stain(rng, h, w, scale)
    return mask, 0.3, colour


def _scratch(rng: np.random.Generator, h: int, w: int, scale: float) -> tuple[F32, float]:
    """One thin line or gentle arc, darker or brighter than the surface (as synth draws)."""
    mask = np.zeros((h, w), np.float32)
    thickness = max(1, round(rng.uniform(1.0, 3.0) * scale))
    # A one-pixel scratch must be starker to be as visible as a wider one.
    low, high = (75.0, 120.0) if thickness == 1 else (45.0, 95.0)
    synth.arc(rng, mask, scale, thickness, (100.0, 360.0))
    return mask, rng.uniform(low, high) * (1 if rng.random() < 0.5 else -1)


def _pits(rng: np.random.Generator, h: int, w: int, scale: float) -> tuple[F32, float]:
    """One to three small round spots close together, mostly dark."""
    mask = np.zeros((h, w), np.float32)
    margin = 8 * scale + 4
    cx, cy = rng.uniform(margin, w - margin), rng.uniform(margin, h - margin)
    spread = rng.uniform(0.0, 10.0) * scale
    for _ in range(int(rng.integers(1, 4))):
        x = int(np.clip(cx + rng.normal(0.0, spread), 4, w - 5))
        y = int(np.clip(cy + rng.normal(0.0, spread), 4, h - 5))
        radius = max(2, round(rng.uniform(3.5, 7.0) * scale))
        cv2.circle(mask, (x, y), radius, 1.0, -1, cv2.LINE_AA)
    mask = np.asarray(cv2.GaussianBlur(mask, (0, 0), 0.8 * scale), np.float32)
    return _unit(mask), rng.uniform(60.0, 110.0) * (-1 if rng.random() < 0.75 else 1)


def _stain(
    rng: np.random.Generator, h: int, w: int, scale: float
) -> tuple[F32, npt.NDArray[np.float64]]:
    """A soft, blotchy, tinted discolouration (synth's, a little smaller)."""
    return synth.stain(rng, h, w, scale, max_radius=75.0)


# --- boxes ------------------------------------------------------------------------------


def _box(mask: F32, level: float, scale: float) -> Box | None:
    """Tight box of ``mask >= level``, grown about its centre to the minimum side."""
    ys = np.flatnonzero((mask >= level).any(axis=1))
    xs = np.flatnonzero((mask >= level).any(axis=0))
    if xs.size == 0 or ys.size == 0:
        return None
    h, w = mask.shape
    side = MIN_SIDE * scale
    x1, x2 = _at_least(float(xs[0]), float(xs[-1] + 1), side, w)
    y1, y2 = _at_least(float(ys[0]), float(ys[-1] + 1), side, h)
    return x1, y1, x2, y2


def _at_least(lo: float, hi: float, side: float, limit: int) -> tuple[float, float]:
    """``[lo, hi)`` grown symmetrically to ``side``, kept inside ``[0, limit]``."""
    grow = max(0.0, side - (hi - lo)) / 2
    lo, hi = lo - grow, hi + grow
    if lo < 0:
        lo, hi = 0.0, min(float(limit), hi - lo)
    if hi > limit:
        lo, hi = max(0.0, lo - (hi - limit)), float(limit)
    return lo, hi


def _iou(a: Box, b: Box) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _grow(present: npt.NDArray[np.bool_], pixels: int) -> npt.NDArray[np.bool_]:
    kernel = np.ones((2 * pixels + 1, 2 * pixels + 1), np.uint8)
    grown = cv2.dilate(present.astype(np.uint8), kernel)
    return np.asarray(grown, np.uint8) > 0


def _unit(mask: F32) -> F32:
    peak = float(mask.max())
    if peak > 0:
        mask /= np.float32(peak)
    return mask
