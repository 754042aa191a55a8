"""Turn a decoded BGR image into the model's input tensor, exactly as its manifest says.

The build script trains on the output of this very function, so whatever it does at serve
time it also did at training time. It must stay free of randomness and of per-call state.
"""

from __future__ import annotations

from functools import lru_cache

import cv2
import numpy as np
import numpy.typing as npt

from sluicegate.vision.geometry import Frame, fit
from sluicegate.vision.manifest import ModelManifest, PreprocessSpec, ResizeSpec

__all__ = ["frame_of", "preprocess", "resize"]

_INTERPOLATION = {
    "area": cv2.INTER_AREA,
    "linear": cv2.INTER_LINEAR,
    "cubic": cv2.INTER_CUBIC,
    "nearest": cv2.INTER_NEAREST,
}


def preprocess(img_bgr: npt.NDArray[np.uint8], manifest: ModelManifest) -> npt.NDArray[np.float32]:
    """Resize, reorder colours and normalise: a float32 NCHW batch of one."""
    if img_bgr.ndim != 3 or img_bgr.shape[2] != 3 or img_bgr.dtype != np.uint8:
        raise ValueError(f"expected an HxWx3 uint8 BGR image, got {img_bgr.shape} {img_bgr.dtype}")
    spec = manifest.preprocess
    size = spec.resize
    if size.mode == "letterbox":
        small = letterbox(img_bgr, frame_of(img_bgr, size), size)
    else:
        small = resize(img_bgr, size.width, size.height, size.interpolation)
    swap = manifest.input.color_order == "RGB"
    return np.asarray(cv2.dnn.blobFromImageWithParams(small, _params(spec, swap)), np.float32)


def frame_of(img: npt.NDArray[np.uint8], size: ResizeSpec) -> Frame:
    """Where ``img`` lands in the model input (see :mod:`sluicegate.vision.geometry`)."""
    return fit(img.shape[1], img.shape[0], size.width, size.height, size.mode)


def letterbox(img: npt.NDArray[np.uint8], frame: Frame, size: ResizeSpec) -> npt.NDArray[np.uint8]:
    """``img`` scaled into ``frame`` and padded to the input size with ``pad_value``."""
    placed_w, placed_h = frame.placed
    scaled = resize(img, placed_w, placed_h, size.interpolation)
    right = size.width - placed_w - frame.pad_x
    bottom = size.height - placed_h - frame.pad_y
    fill = (size.pad_value,) * 3
    out = cv2.copyMakeBorder(
        scaled, frame.pad_y, bottom, frame.pad_x, right, cv2.BORDER_CONSTANT, value=fill
    )
    return np.asarray(out, np.uint8)


def resize(
    img: npt.NDArray[np.uint8], width: int, height: int, interpolation: str
) -> npt.NDArray[np.uint8]:
    """Resize to width x height with the named OpenCV interpolation.

    An "area" shrink by an exact power of two is done in 2x steps: OpenCV's area filter
    has a vectorised path for exactly 2x only (4x on 640x480 costs ~4x as much as two 2x
    steps), and box-averaging in halves gives the same result up to uint8 rounding.
    """
    h, w = img.shape[:2]
    if (w, h) == (width, height):
        return img
    if interpolation == "area" and _power_of_two_shrink(w, h, width, height):
        while (w, h) != (width, height):
            w, h = w // 2, h // 2
            img = np.asarray(cv2.resize(img, (w, h), interpolation=cv2.INTER_AREA), np.uint8)
        return img
    out = cv2.resize(img, (width, height), interpolation=_INTERPOLATION[interpolation])
    return np.asarray(out, np.uint8)


def _power_of_two_shrink(w: int, h: int, width: int, height: int) -> bool:
    factor = w // width
    return factor > 1 and factor & (factor - 1) == 0 and (w, h) == (width * factor, height * factor)


@lru_cache(maxsize=32)
def _params(spec: PreprocessSpec, swap_rb: bool) -> cv2.dnn.Image2BlobParams:
    # blobFromImage computes (pixel - mean) * scalefactor per output channel, so
    # (pixel * scale - m) / s == (pixel - m / scale) * (scale / s).
    params = cv2.dnn.Image2BlobParams()
    params.scalefactor = (*(spec.scale / s for s in spec.std), 0.0)
    params.mean = (*(m / spec.scale for m in spec.mean), 0.0)
    params.size = (spec.resize.width, spec.resize.height)
    params.swapRB = swap_rb
    params.ddepth = cv2.CV_32F
    return params
