"""One batch from image bytes to per-job outputs; runs on the worker's executor threads.

Each job is decoded and preprocessed on its own (``LoadedModel.prepare``, the same path the
edge uses, so a pool result equals an edge result for the same image), the tensors are
concatenated along the batch dimension and the model runs once (``LoadedModel.run``), then
each job gets its own outputs back. One undecodable image is rejected alone; the rest of its
batch still runs. A failing ``session.run`` fails the jobs of that batch, never the worker.
This module owns no threads, no clock of the event loop and no transport.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sluicegate.errors import ImageError
from sluicegate.vision.geometry import Frame
from sluicegate.vision.image import ImageInfo
from sluicegate.vision.image import PayloadLimits as Limits
from sluicegate.vision.postprocess import Outputs
from sluicegate.vision.runtime import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ItemRun:
    """One job's part of a batch: its outputs, or the code and reason it has none."""

    outputs: Outputs | None
    code: str | None
    reason: str | None
    decode_ms: float
    preprocess_ms: float
    ran: bool = False  # it went into session.run (ok or failed there): an attempt that ran

    @property
    def ok(self) -> bool:
        return self.outputs is not None


@dataclass(frozen=True, slots=True)
class BatchRun:
    """What a batch produced: one ``ItemRun`` per job, in the order given."""

    items: tuple[ItemRun, ...]
    inference_ms: float  # the one session.run plus postprocess, shared by the batch
    batch_size: int  # how many jobs went into session.run together

    @property
    def compute_ms(self) -> float:
        """Decode + preprocess of every job plus the shared inference."""
        return self.inference_ms + sum(i.decode_ms + i.preprocess_ms for i in self.items)


def run_batch(
    model: LoadedModel, jobs: Sequence[tuple[bytes, ImageInfo]], *, limits: Limits
) -> BatchRun:
    """Decode, preprocess, run once and postprocess ``jobs`` (payload, probed header)."""
    tensors: list[npt.NDArray[np.float32]] = []
    frames: list[Frame] = []
    slots: list[int] = []
    prepared: list[ItemRun] = []
    for index, (payload, info) in enumerate(jobs):
        try:
            tensor, decode_ms, preprocess_ms, frame = model.prepare(
                payload, info=info, max_pixels=limits.max_pixels, max_side=limits.max_side
            )
        except ImageError as exc:
            prepared.append(ItemRun(None, "bad_image", str(exc), 0.0, 0.0))
            continue
        except Exception as exc:  # OpenCV's and numpy's own errors: this job's result
            log.exception("preprocessing failed")
            reason = f"preprocessing failed: {type(exc).__name__}: {exc}"
            prepared.append(ItemRun(None, "inference_error", reason, 0.0, 0.0))
            continue
        tensors.append(tensor)
        frames.append(frame)
        slots.append(index)
        prepared.append(ItemRun(None, None, None, decode_ms, preprocess_ms))
    if not tensors:
        return BatchRun(tuple(prepared), 0.0, 0)
    t0 = time.perf_counter()
    try:
        if model.batchable:
            batch = tensors[0] if len(tensors) == 1 else np.concatenate(tensors, axis=0)
            outputs = model.run(batch, frames)
        else:  # each image at its own size (OCR): one run each
            outputs = [
                out for t, f in zip(tensors, frames, strict=True) for out in model.run(t, [f])
            ]
        if len(outputs) != len(tensors):
            raise RuntimeError(f"model returned {len(outputs)} outputs for {len(tensors)} inputs")
    except Exception as exc:  # onnxruntime raises its own untyped errors: the jobs' result
        log.exception("inference failed for a batch of %d %s jobs", len(tensors), model)
        reason = f"inference failed: {type(exc).__name__}: {exc}"
        inference_ms = (time.perf_counter() - t0) * 1e3
        for index in slots:
            item = prepared[index]
            prepared[index] = ItemRun(
                None, "inference_error", reason, item.decode_ms, item.preprocess_ms, ran=True
            )
        return BatchRun(tuple(prepared), inference_ms, len(tensors))
    inference_ms = (time.perf_counter() - t0) * 1e3
    for index, result in zip(slots, outputs, strict=True):
        item = prepared[index]
        prepared[index] = ItemRun(result, None, None, item.decode_ms, item.preprocess_ms, ran=True)
    return BatchRun(tuple(prepared), inference_ms, len(tensors))
