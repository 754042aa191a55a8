"""Where an original image sits inside the model's input, and back again.

A manifest's resize either stretches the image to the input size or letterboxes it (scaled
to fit with its aspect ratio kept, padded, centred). :func:`fit` says where it lands, as a
:class:`Frame`; :func:`to_image` maps boxes from model-input pixels back to fractions of the
original image, which is how every result reports them. Pure arithmetic on plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["Frame", "fit", "to_image"]

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Frame:
    """An image of ``width`` x ``height`` placed in the input as ``input = image * scale +
    pad`` on each axis (pixels)."""

    width: int
    height: int
    scale_x: float
    scale_y: float
    pad_x: int = 0
    pad_y: int = 0

    @property
    def placed(self) -> tuple[int, int]:
        """The image's size inside the input (before padding)."""
        return round(self.width * self.scale_x), round(self.height * self.scale_y)


def fit(
    width: int,
    height: int,
    input_width: int,
    input_height: int,
    mode: Literal["stretch", "letterbox"] = "stretch",
) -> Frame:
    """Where a ``width`` x ``height`` image lands in an ``input_width`` x ``input_height``
    input: stretched to it, or letterboxed (scaled to fit, the padding split evenly with the
    odd pixel right and bottom, as the YOLO exporters do)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"an image has a positive size, got {width}x{height}")
    if mode == "stretch":
        return Frame(width, height, input_width / width, input_height / height)
    scale = min(input_width / width, input_height / height)
    placed_w = min(input_width, max(1, round(width * scale)))
    placed_h = min(input_height, max(1, round(height * scale)))
    return Frame(
        width,
        height,
        placed_w / width,
        placed_h / height,
        (input_width - placed_w) // 2,
        (input_height - placed_h) // 2,
    )


def to_image(boxes: F32, frame: Frame) -> F32:
    """``[K, 4]`` xyxy boxes in model-input pixels as fractions of the original image,
    clipped to ``[0, 1]``."""
    offset = np.array([frame.pad_x, frame.pad_y, frame.pad_x, frame.pad_y], np.float32)
    per_px = np.array(
        [
            1.0 / (frame.scale_x * frame.width),
            1.0 / (frame.scale_y * frame.height),
            1.0 / (frame.scale_x * frame.width),
            1.0 / (frame.scale_y * frame.height),
        ],
        np.float32,
    )
    placed: F32 = np.clip((boxes - offset) * per_px, np.float32(0.0), np.float32(1.0))
    return placed
