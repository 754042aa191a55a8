"""Synthetic part labels with serial numbers, for the OCR model's tests, bench and demo.

A label is a light sticker on a machined surface (:mod:`sluicegate.vision.synth`) carrying
one or two printed lines: a serial number (``SN 7K4Q-20931``) and, on some, a part or lot
line. It is drawn with one of OpenCV's Hershey fonts, then seen as a camera on a line sees
it: a slight perspective and rotation, uneven light, defocus blur and sensor noise, JPEG
compression by the caller. Deterministic for a given generator state.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np
import numpy.typing as npt

from sluicegate.vision import synth

__all__ = ["Label", "generate_label", "serial"]

U8 = npt.NDArray[np.uint8]
ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no I/1 or O/0: serials avoid them
FONTS = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_TRIPLEX)


@dataclass(frozen=True)
class Label:
    image: U8  # BGR
    lines: tuple[str, ...]  # the printed text, top to bottom


def serial(rng: np.random.Generator) -> str:
    """A serial number: ``SN`` then four characters, a dash and five digits."""
    head = "".join(ALPHABET[int(i)] for i in rng.integers(0, len(ALPHABET), 4))
    tail = "".join(str(int(d)) for d in rng.integers(0, 10, 5))
    return f"SN {head}-{tail}"


def _part(rng: np.random.Generator) -> str:
    return f"P/N {int(rng.integers(100, 999))}-{int(rng.integers(1000, 9999))}"


def generate_label(
    rng: np.random.Generator, *, width: int = 320, height: int = 160, two_lines: bool | None = None
) -> Label:
    """A label image and its text."""
    if two_lines is None:
        two_lines = bool(rng.random() < 0.5)
    lines = (serial(rng), _part(rng)) if two_lines else (serial(rng),)
    background, _ = synth.generate(rng, "ok", width=max(64, width), height=max(64, height))
    sticker = _sticker(rng, lines, width, height)
    image = _place(rng, background, sticker)
    image = _camera(rng, image)
    return Label(image, lines)


def _sticker(rng: np.random.Generator, lines: tuple[str, ...], width: int, height: int) -> U8:
    font = FONTS[int(rng.integers(len(FONTS)))]
    thickness = int(rng.integers(1, 3))
    paper = int(rng.integers(205, 250))
    ink = int(rng.integers(10, 60))
    w, h = int(width * rng.uniform(0.78, 0.92)), int(height * rng.uniform(0.6, 0.85))
    sticker = np.full((h, w, 3), paper, np.uint8)
    rows = len(lines)
    scale = _fit_scale(lines, font, thickness, w * 0.9, h / rows * 0.62)
    for i, text in enumerate(lines):
        (tw, th), _ = cv2.getTextSize(text, font, scale, thickness)
        x = int((w - tw) * rng.uniform(0.2, 0.8))
        y = int(h * (i + 0.5) / rows + th / 2)
        cv2.putText(sticker, text, (x, y), font, scale, (ink, ink, ink), thickness, cv2.LINE_AA)
    cv2.rectangle(sticker, (1, 1), (w - 2, h - 2), (ink + 60,) * 3, 1)
    return sticker


def _fit_scale(
    lines: tuple[str, ...], font: int, thickness: int, width: float, height: float
) -> float:
    widest = max(cv2.getTextSize(t, font, 1.0, thickness)[0][0] for t in lines)
    tallest = max(cv2.getTextSize(t, font, 1.0, thickness)[0][1] for t in lines)
    return float(min(width / widest, height / tallest))


def _place(rng: np.random.Generator, background: U8, sticker: U8) -> U8:
    """The sticker on the surface, slightly turned and in perspective."""
    bh, bw = background.shape[:2]
    sh, sw = sticker.shape[:2]
    x0, y0 = (bw - sw) / 2, (bh - sh) / 2
    corners = np.array([[0, 0], [sw, 0], [sw, sh], [0, sh]], np.float32)
    jitter = rng.uniform(-0.04, 0.04, (4, 2)) * np.array([sw, sh])
    angle = np.deg2rad(rng.uniform(-4, 4))
    turn = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    centred = (corners - [sw / 2, sh / 2]) @ turn.T + [sw / 2 + x0, sh / 2 + y0] + jitter
    warp = cv2.getPerspectiveTransform(corners, centred.astype(np.float32))
    placed = cv2.warpPerspective(sticker, warp, (bw, bh), flags=cv2.INTER_LINEAR)
    mask = cv2.warpPerspective(np.full((sh, sw), 255, np.uint8), warp, (bw, bh))
    out = background.copy()
    out[mask > 127] = placed[mask > 127]
    return out


def _camera(rng: np.random.Generator, image: U8) -> U8:
    w = image.shape[1]
    light = np.linspace(rng.uniform(0.8, 1.0), rng.uniform(0.9, 1.1), w, dtype=np.float32)
    lit = image.astype(np.float32) * light[None, :, None]
    sigma = rng.uniform(0.3, 1.0)
    blurred = cv2.GaussianBlur(lit, (0, 0), sigma)
    noisy = blurred + rng.normal(0.0, rng.uniform(2.0, 5.0), blurred.shape)
    out: U8 = np.clip(noisy, 0, 255).astype(np.uint8)
    return out
