"""Read a model's raw output tensors into labelled results, one per batch item.

Which reading applies is the manifest's ``postprocess.kind``: ``classification`` (one score
per label), ``detection`` (the exporter's layout, then per-label non-maximum suppression:
:mod:`sluicegate.vision.detection`) or ``anomaly`` (a score map and the image's verdict:
:mod:`sluicegate.vision.anomaly`). Boxes and regions come back as fractions of each
original image, for which the caller passes the :class:`~sluicegate.vision.geometry.Frame`
it was placed in (by default: stretched, as classification does). Pure NumPy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sluicegate.errors import OutputError
from sluicegate.vision.anomaly import Region, read_maps
from sluicegate.vision.detection import Detection, detect, nms
from sluicegate.vision.geometry import Frame
from sluicegate.vision.manifest import (
    AnomalyPostprocess,
    ClassificationPostprocess,
    ModelManifest,
    OcrPostprocess,
)
from sluicegate.vision.ocr import TextLine

__all__ = ["Detection", "Outputs", "Region", "TextLine", "nms", "postprocess"]

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Outputs:
    label: str | None
    scores: dict[str, float]
    detections: tuple[Detection, ...] = ()
    regions: tuple[Region, ...] = ()
    texts: tuple[TextLine, ...] = ()  # an OCR model's lines, in reading order
    version: str | None = None  # the build of the model that answered (its manifest's)
    sha256: str | None = None  # and its file's


def postprocess(
    raw: list[npt.NDArray[np.generic]],
    manifest: ModelManifest,
    frames: Sequence[Frame] | None = None,
) -> list[Outputs]:
    """``raw`` holds the graph outputs named by ``manifest.output_names``, in that order;
    ``frames`` says where each image sat in the input (default: stretched over it)."""
    post = manifest.postprocess
    expected = len(manifest.output_names)
    if len(raw) != expected:
        raise OutputError(f"expected {expected} output tensor(s), got {len(raw)}")
    if isinstance(post, ClassificationPostprocess):
        return _classification(np.asarray(raw[0], np.float32), post, manifest.labels)
    if isinstance(post, OcrPostprocess):
        raise OutputError("an OCR model's outputs are read by its model (ocr_model), not here")
    size = (manifest.input.width, manifest.input.height)
    if frames is None:
        batch = int(np.shape(raw[0])[0]) if np.ndim(raw[0]) else 0
        frames = [Frame(size[0], size[1], 1.0, 1.0)] * batch
    if isinstance(post, AnomalyPostprocess):
        normal, anomalous = manifest.labels
        return [
            Outputs(
                label=anomalous if v.anomalous else normal,
                scores={anomalous: v.score},
                regions=v.regions,
            )
            for v in read_maps(raw, post, size, frames)
        ]
    results = []
    for found in detect(raw, post, manifest.labels, size, frames):
        best = dict.fromkeys(manifest.labels, 0.0)
        for det in found:
            best[det.label] = max(best[det.label], det.score)
        results.append(
            Outputs(label=found[0].label if found else None, scores=best, detections=found)
        )
    return results


def _classification(
    scores: F32, post: ClassificationPostprocess, labels: tuple[str, ...]
) -> list[Outputs]:
    if scores.ndim != 2 or scores.shape[1] != len(labels):
        raise OutputError(
            f"output {post.output!r} has shape {list(scores.shape)}; expected [N, {len(labels)}]"
        )
    nan = int(np.isnan(scores).sum())
    if nan:
        raise OutputError(
            f"output {post.output!r} holds {nan} NaN score(s) of {scores.size}: the model's "
            "answer cannot be read"
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
