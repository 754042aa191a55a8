"""An OCR model: two ONNX sessions (text detection, then recognition) served under one
model name, with the pure steps of :mod:`sluicegate.vision.ocr` between them.

Its manifest's ``file`` is the detector and ``postprocess.recognizer`` names the recogniser
with its own sha256; both are verified like any model file. The recogniser's character set
is read from its metadata (``character``, one per line, as PaddleOCR exports write it),
with the space PaddleOCR appends. Images differ in size, so an OCR model takes one image
per run (``batchable`` is false); the detected lines are recognised in batches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from sluicegate.errors import ModelIntegrityError, OutputError
from sluicegate.vision.geometry import Frame
from sluicegate.vision.image import ImageInfo, check_dimensions, decode, probe
from sluicegate.vision.manifest import ModelManifest, OcrPostprocess
from sluicegate.vision.ocr import (
    TextLine,
    crop,
    ctc_greedy,
    detector_size,
    recogniser_batch,
    text_boxes,
)
from sluicegate.vision.postprocess import Outputs

__all__ = ["ImageFrame", "charset_of", "read_text"]

F32 = npt.NDArray[np.float32]
REC_BATCH = 6  # lines recognised per recogniser call


@dataclass(frozen=True)
class ImageFrame(Frame):
    """A frame that keeps the decoded image: the recogniser reads crops of it."""

    image: Any = None


def charset_of(session: Any, where: str) -> tuple[str, ...]:
    """The recogniser's characters from its metadata, the space appended."""
    meta = session.get_modelmeta().custom_metadata_map
    text = meta.get("character")
    if not text:
        raise ModelIntegrityError(
            f"{where}: the recogniser's metadata has no 'character' entry; its character "
            "set cannot be known"
        )
    return (*text.splitlines(), " ")


def prepare_image(
    manifest: ModelManifest,
    data: bytes,
    *,
    info: ImageInfo | None = None,
    max_pixels: int | None = None,
    max_side: int | None = None,
) -> tuple[F32, float, float, ImageFrame]:
    """The detector's input for one image: scaled to :func:`detector_size` and normalised
    as the manifest says; the frame keeps the full image."""
    t0 = time.perf_counter()
    info = info or probe(data)
    if max_pixels is not None or max_side is not None:
        check_dimensions(
            info,
            max_pixels=max_pixels if max_pixels is not None else info.pixels,
            max_side=max_side if max_side is not None else max(info.width, info.height),
        )
    image = decode(data)
    t1 = time.perf_counter()
    post = manifest.postprocess
    assert isinstance(post, OcrPostprocess)
    height, width = image.shape[:2]
    longest = max(manifest.input.width, manifest.input.height)
    dw, dh = detector_size(width, height, max_side=longest, min_side=post.min_side)
    spec = manifest.preprocess
    scaled = cv2.resize(image, (dw, dh), interpolation=cv2.INTER_LINEAR).astype(np.float32)
    if manifest.input.color_order == "RGB":
        scaled = scaled[..., ::-1]
    mean = np.array(spec.mean, np.float32)
    std = np.array(spec.std, np.float32)
    tensor = ((scaled * np.float32(spec.scale) - mean) / std).transpose(2, 0, 1)[None]
    frame = ImageFrame(width, height, dw / width, dh / height, image=image)
    return (
        np.ascontiguousarray(tensor, np.float32),
        (t1 - t0) * 1e3,
        (time.perf_counter() - t1) * 1e3,
        frame,
    )


def read_text(
    manifest: ModelManifest,
    detector: Any,
    recogniser: Any,
    charset: Sequence[str],
    batch: F32,
    frames: Sequence[Frame],
) -> list[Outputs]:
    """Detect, crop and recognise each image of ``batch`` (one per frame)."""
    post = manifest.postprocess
    assert isinstance(post, OcrPostprocess)
    results = []
    for i, frame in enumerate(frames):
        if not isinstance(frame, ImageFrame) or frame.image is None:
            raise OutputError("an OCR model reads crops of the image: prepare it with the model")
        (prob,) = detector.run([post.output], {manifest.input.name: batch[i : i + 1]})
        prob = np.asarray(prob, np.float32)
        if prob.ndim != 4 or prob.shape[:2] != (1, 1):
            raise OutputError(
                f"output {post.output!r} has shape {list(prob.shape)}; expected [1, 1, H, W]"
            )
        if np.isnan(prob).any():
            raise OutputError(
                f"output {post.output!r} holds NaN: the model's answer cannot be read"
            )
        found = text_boxes(
            prob[0, 0],
            (frame.width, frame.height),
            threshold=post.threshold,
            box_threshold=post.box_threshold,
            unclip_ratio=post.unclip_ratio,
            max_candidates=post.max_candidates,
        )
        lines: list[TextLine] = []
        rec = post.recognizer
        for start in range(0, len(found), REC_BATCH):
            part = found[start : start + REC_BATCH]
            crops = [crop(frame.image, quad) for quad, _ in part]
            tensor = recogniser_batch(crops, height=rec.height, min_width=rec.min_width)
            (probs,) = recogniser.run([rec.output], {rec.input: tensor})
            for (quad, _score), (text, confidence) in zip(
                part, ctc_greedy(np.asarray(probs, np.float32), charset), strict=True
            ):
                if text.strip() and confidence >= post.text_threshold:
                    lines.append(_line(text, confidence, quad, frame))
        results.append(Outputs(label=None, scores={}, texts=tuple(lines)))
    return results


def _line(text: str, confidence: float, quad: F32, frame: Frame) -> TextLine:
    scale = np.array([1.0 / frame.width, 1.0 / frame.height], np.float32)
    corners = np.clip(quad * scale, 0.0, 1.0)
    x1, y1 = (float(v) for v in corners.min(axis=0))
    x2, y2 = (float(v) for v in corners.max(axis=0))
    return TextLine(
        text.strip(),
        confidence,
        (x1, y1, x2, y2),
        tuple((float(x), float(y)) for x, y in corners),
    )
