"""Synthetic industrial surface images with known defects, generated with OpenCV.

This module owns the picture generator that trains ``models/defect-v1`` and feeds the
demo, the tests and the benchmarks. Everything is drawn from the ``numpy.random.Generator``
passed in, so a seed gives the same image on every run; it must never read the global
NumPy or OpenCV random state.

The background (surface kind, brushing, die grid, illumination, sensor noise) is drawn the
same way for every label, so the only thing that tells labels apart is the defect.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import cv2
import numpy as np
import numpy.typing as npt

from sluicegate.errors import ImageError

LABELS: tuple[str, ...] = ("ok", "scratch", "pit", "stain")

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

# Standard normal quantiles of 256 equal-probability bins: random bytes looked up here give
# Gaussian noise about ten times faster than Generator.standard_normal.
_GAUSS_LUT = np.array(
    [NormalDist().inv_cdf((i + 0.5) / 256) for i in range(256)], np.float32
).reshape(1, 256)


def generate(
    rng: np.random.Generator,
    label: str | None = None,
    *,
    width: int = 640,
    height: int = 480,
) -> tuple[U8, str]:
    """Return a BGR uint8 image of a surface and its label (drawn at random when None)."""
    if label is None:
        label = LABELS[int(rng.integers(len(LABELS)))]
    elif label not in LABELS:
        raise ValueError(f"unknown label {label!r}; known: {', '.join(LABELS)}")
    if width < 64 or height < 64:
        raise ValueError(f"image must be at least 64x64, got {width}x{height}")
    scale = math.sqrt(width * height / (640 * 480))

    surface, _kind = _surface(rng, height, width, scale)
    if label == "scratch":
        _add_scratches(rng, surface, scale)
    elif label == "pit":
        _add_pits(rng, surface, scale)
    elif label == "stain":
        _add_stain(rng, surface, scale)

    surface *= _illumination(rng, height, width)[..., None]
    surface += _noise(rng, surface.shape) * np.float32(rng.uniform(4.0, 5.5))
    return np.clip(surface, 0, 255).astype(np.uint8), label


def encode_jpeg(img: U8, quality: int = 90) -> bytes:
    """Encode a BGR uint8 image as baseline JPEG."""
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise ImageError(f"OpenCV could not encode a {img.shape} image as JPEG")
    return bytes(buf)


def encode_png(img: U8, compression: int = 1) -> bytes:
    """Encode a BGR uint8 image as PNG (fast, low compression by default)."""
    ok, buf = cv2.imencode(".png", img, [cv2.IMWRITE_PNG_COMPRESSION, int(compression)])
    if not ok:
        raise ImageError(f"OpenCV could not encode a {img.shape} image as PNG")
    return bytes(buf)


# --- background -------------------------------------------------------------------------


def _noise(rng: np.random.Generator, shape: tuple[int, ...]) -> F32:
    """Unit Gaussian noise, quantised to 256 levels."""
    raw = np.frombuffer(rng.bytes(math.prod(shape)), np.uint8).reshape(shape)
    return np.asarray(cv2.LUT(raw, _GAUSS_LUT), np.float32)


SURFACES = ("brushed metal", "wafer", "cast metal")  # what _surface draws, by index


def _surface(rng: np.random.Generator, h: int, w: int, scale: float) -> tuple[F32, str]:
    """A defect-free surface in float32 BGR, before illumination and sensor noise, and
    which of :data:`SURFACES` it is."""
    kind = int(rng.integers(3))
    if kind == 0:
        base = _metal_colour(rng)
        texture = _brushed(rng, h, w, scale) * np.float32(rng.uniform(5.0, 11.0))
    elif kind == 1:
        base = _wafer_colour(rng)
        texture = _die_grid(rng, h, w, scale) + _grain(rng, h, w, 1.2 * scale, 3.0)
    else:
        base = _metal_colour(rng)
        texture = _grain(rng, h, w, rng.uniform(1.0, 2.2) * scale, rng.uniform(6.0, 10.0))
    out = np.empty((h, w, 3), np.float32)
    for c in range(3):
        np.add(texture, np.float32(base[c]), out=out[..., c])
    return out, SURFACES[kind]


def _metal_colour(rng: np.random.Generator) -> npt.NDArray[np.float64]:
    level = rng.uniform(85.0, 180.0)
    tint = rng.normal(0.0, 0.04, 3)
    return level * (1.0 + tint)


def _wafer_colour(rng: np.random.Generator) -> npt.NDArray[np.float64]:
    palette = np.array(
        [(150.0, 110.0, 120.0), (140.0, 135.0, 95.0), (95.0, 130.0, 150.0), (160.0, 150.0, 150.0)]
    )
    colour: npt.NDArray[np.float64] = palette[int(rng.integers(len(palette)))]
    return colour * rng.uniform(0.8, 1.15)


def _brushed(rng: np.random.Generator, h: int, w: int, scale: float) -> F32:
    """Unit-variance streaks along a random direction, like brushed or ground metal."""
    d = int(math.hypot(h, w)) + 4
    length = rng.uniform(12.0, 48.0) * scale
    # Noise stretched along x: each row becomes streaks about `length` pixels long.
    noise = _noise(rng, (d, max(2, int(d / length))))
    streak = cv2.resize(noise, (d, d), interpolation=cv2.INTER_CUBIC)
    rot = cv2.getRotationMatrix2D((d / 2, d / 2), float(rng.uniform(0.0, 180.0)), 1.0)
    rot[0, 2] += (w - d) / 2
    rot[1, 2] += (h - d) / 2
    return np.asarray(cv2.warpAffine(streak, rot, (w, h), flags=cv2.INTER_LINEAR), np.float32)


def _grain(rng: np.random.Generator, h: int, w: int, sigma: float, amplitude: float) -> F32:
    """Isotropic blurred noise with roughly the given standard deviation."""
    noise = _noise(rng, (h, w))
    blurred = cv2.GaussianBlur(noise, (0, 0), sigma)
    # A Gaussian blur of white noise has std 1 / (2 * sqrt(pi) * sigma).
    out: F32 = blurred * np.float32(amplitude * 2.0 * math.sqrt(math.pi) * sigma)
    return out


def _die_grid(rng: np.random.Generator, h: int, w: int, scale: float) -> F32:
    """Periodic dicing streets of a wafer: soft, low-contrast, slightly rotated."""
    pitches = (rng.uniform(70.0, 150.0) * scale, 0.0)
    pitches = (pitches[0], pitches[0] * rng.uniform(0.7, 1.3))
    street = max(1, round(rng.uniform(2.0, 4.0) * scale))
    angle = math.radians(rng.uniform(-4.0, 4.0))
    along = np.array([math.cos(angle), math.sin(angle)])
    across = np.array([-math.sin(angle), math.cos(angle)])
    reach = math.hypot(h, w)
    centre = np.array([w / 2, h / 2])
    mask = np.zeros((h, w), np.float32)
    for pitch, normal, direction in ((pitches[0], along, across), (pitches[1], across, along)):
        offset = rng.uniform(0.0, pitch)
        for k in range(-int(reach / pitch) - 1, int(reach / pitch) + 2):
            mid = centre + normal * (k * pitch + offset)
            a = (mid - direction * reach).astype(np.int32)
            b = (mid + direction * reach).astype(np.int32)
            cv2.line(mask, (int(a[0]), int(a[1])), (int(b[0]), int(b[1])), 1.0, street, cv2.LINE_AA)
    mask = np.asarray(cv2.GaussianBlur(mask, (0, 0), 0.8 * scale), np.float32)
    contrast = np.float32(rng.uniform(6.0, 14.0) * (1 if rng.random() < 0.5 else -1))
    out: F32 = mask * contrast
    return out


def _illumination(rng: np.random.Generator, h: int, w: int) -> F32:
    """A smooth multiplicative light field: a tilt plus a broad hotspot or vignette."""
    ys, xs = np.ogrid[0:h, 0:w]
    xn = (xs.astype(np.float32) - w / 2) / max(h, w)
    yn = (ys.astype(np.float32) - h / 2) / max(h, w)
    gx, gy = (float(v) for v in rng.uniform(-0.35, 0.35, 2))
    cx, cy = (float(v) for v in rng.uniform(-0.5, 0.5, 2))
    spread = float(rng.uniform(0.35, 0.9))
    spot = np.exp(((xn - cx) ** 2 + (yn - cy) ** 2) * (-0.5 / spread**2))
    field = 1.0 + gx * xn + gy * yn + float(rng.uniform(-0.15, 0.25)) * spot
    out: F32 = np.clip(field, 0.6, 1.4).astype(np.float32)
    return out


# --- defects ----------------------------------------------------------------------------


def _add_scratches(rng: np.random.Generator, surface: F32, scale: float) -> None:
    """Thin long lines or gentle arcs, darker or brighter than the surface."""
    h, w = surface.shape[:2]
    mask = np.zeros((h, w), np.float32)
    thickness = max(1, round(rng.uniform(1.0, 3.0) * scale))
    # A one-pixel scratch must be starker to be as visible as a wider one: an inspector
    # (or a 160x120 model input) sees roughly contrast times width.
    low, high = (75.0, 120.0) if thickness == 1 else (45.0, 95.0)
    for _ in range(1 if rng.random() < 0.75 else 2):
        arc(rng, mask, scale, thickness, (120.0, 380.0))
    contrast = rng.uniform(low, high) * (1 if rng.random() < 0.5 else -1)
    surface += (mask * np.float32(contrast))[..., None]


def _add_pits(rng: np.random.Generator, surface: F32, scale: float) -> None:
    """A few small round spots, mostly dark, sometimes clustered."""
    h, w = surface.shape[:2]
    mask = np.zeros((h, w), np.float32)
    cx, cy = rng.uniform(0.1 * w, 0.9 * w), rng.uniform(0.1 * h, 0.9 * h)
    count = int(rng.integers(1, 7))
    spread = rng.uniform(0.0, 40.0) * scale
    for _ in range(count):
        x = int(np.clip(cx + rng.normal(0.0, spread), 8, w - 8))
        y = int(np.clip(cy + rng.normal(0.0, spread), 8, h - 8))
        radius = max(2, round(rng.uniform(3.5, 7.0) * scale))
        cv2.circle(mask, (x, y), radius, 1.0, -1, cv2.LINE_AA)
    mask = np.asarray(cv2.GaussianBlur(mask, (0, 0), 0.8 * scale), np.float32)
    contrast = rng.uniform(60.0, 110.0) * (-1 if rng.random() < 0.75 else 1)
    surface += (mask * np.float32(contrast))[..., None]


def arc(
    rng: np.random.Generator,
    mask: F32,
    scale: float,
    thickness: int,
    lengths: tuple[float, float],
) -> None:
    """Draw into ``mask`` one line or gentle arc of a random length in ``lengths`` (at
    640x480), direction and place in the middle of the image."""
    h, w = mask.shape
    length = rng.uniform(*lengths) * scale
    theta = rng.uniform(0.0, math.pi)
    cx, cy = rng.uniform(0.2 * w, 0.8 * w), rng.uniform(0.2 * h, 0.8 * h)
    dx, dy = math.cos(theta) * length / 2, math.sin(theta) * length / 2
    bend = rng.uniform(-0.25, 0.25) * length
    p0 = np.array([cx - dx, cy - dy])
    p2 = np.array([cx + dx, cy + dy])
    p1 = np.array([cx, cy]) + bend * np.array([-math.sin(theta), math.cos(theta)])
    t = np.linspace(0.0, 1.0, 24)[:, None]
    pts = (1 - t) ** 2 * p0 + 2 * (1 - t) * t * p1 + t**2 * p2
    cv2.polylines(mask, [pts.astype(np.int32)], False, 1.0, thickness, cv2.LINE_AA)


def _add_stain(rng: np.random.Generator, surface: F32, scale: float) -> None:
    """A soft, blotchy, tinted discolouration made of overlapping blurred ellipses."""
    h, w = surface.shape[:2]
    mask, colour = stain(rng, h, w, scale)
    for c in range(3):
        surface[..., c] += mask * np.float32(colour[c])


def stain(
    rng: np.random.Generator, h: int, w: int, scale: float, *, max_radius: float = 85.0
) -> tuple[F32, npt.NDArray[np.float64]]:
    """A stain's mask (0..1, ``h`` x ``w``) and its colour per channel: overlapping blurred
    ellipses around a random centre, of radius 30 to ``max_radius`` at 640x480."""
    # Drawn and blurred at quarter size: the stain is smooth, and this is 16x less work.
    q = 4
    small = np.zeros((h // q, w // q), np.float32)
    radius = rng.uniform(30.0, max_radius) * scale / q
    cx, cy = rng.uniform(0.15, 0.85) * w / q, rng.uniform(0.15, 0.85) * h / q
    for _ in range(int(rng.integers(3, 8))):
        x = int(cx + rng.normal(0.0, radius / 2))
        y = int(cy + rng.normal(0.0, radius / 2))
        axes = (
            max(1, int(rng.uniform(0.3, 0.8) * radius)),
            max(1, int(rng.uniform(0.3, 0.8) * radius)),
        )
        angle = float(rng.uniform(0.0, 180.0))
        cv2.ellipse(small, (x, y), axes, angle, 0.0, 360.0, 1.0, -1, cv2.LINE_AA)
    small = np.asarray(cv2.GaussianBlur(small, (0, 0), radius / 4), np.float32)
    peak = float(small.max())
    if peak > 0:
        small /= np.float32(peak)
    mask = np.asarray(cv2.resize(small, (w, h), interpolation=cv2.INTER_LINEAR), np.float32)
    tint = rng.uniform(0.3, 1.0, 3)
    tint /= tint.max()
    amplitude = rng.uniform(28.0, 55.0) * (-1 if rng.random() < 0.8 else 1)
    return mask, amplitude * tint
