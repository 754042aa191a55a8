"""The surface-defect detector's data: the manifest it ships with, the synthetic images it
is trained on and judged by, made the way a line camera's arrive, and its held-out score.

An image (:func:`image`) is a surface from :mod:`sluicegate.vision.synth_boxes` with its
defects' boxes, at one of the cameras' sizes, encoded as a JPEG of quality 60-98: all of it
fixed by (seed, stream, index), so the training, held-out and verification streams never
share an image and a rebuild sees the same ones. :func:`dataset` turns ``n`` of them into
inputs with the runtime's own ``LoadedModel.prepare`` under :func:`manifest` (the manifest
that ships), kept as uint8 levels, and maps each box into input pixels through the returned
frame, over a pool of processes. :func:`evaluate` scores a built model (mAP@0.5,
:mod:`sluicegate.vision.metrics`) on a stream training never saw, through the serving path
(``LoadedModel.infer_bytes``). No torch here: the training in ``build_detector.py`` is what
needs it.
"""

from __future__ import annotations

import multiprocessing
import statistics
from pathlib import Path

import numpy as np
import numpy.typing as npt

from sluicegate.vision import synth_boxes
from sluicegate.vision.manifest import ModelManifest
from sluicegate.vision.metrics import Prediction, Truth, mean_average_precision
from sluicegate.vision.runtime import LoadedModel, ModelRegistry

NAME = "surface-det"
VERSION = "1.0.0"
OPSET = 17
INPUT = 256  # square letterboxed input, INPUT x INPUT
LABELS = synth_boxes.LABELS
TRAIN_STREAM, HELDOUT_STREAM, VERIFY_STREAM = 0, 1, 2
# Mostly the line cameras' 320x240; some other sizes and aspect ratios, portrait included.
SIZES = ((320, 240),) * 6 + ((640, 480), (256, 256), (400, 224), (240, 320))
U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]

SCORE_THRESHOLD = 0.25  # what a node reports; the mAP is also given at 0.05


def manifest(sha256: str = "0" * 64, score_threshold: float = SCORE_THRESHOLD) -> ModelManifest:
    return ModelManifest.model_validate(
        {
            "name": NAME,
            "version": VERSION,
            "file": f"{NAME}.onnx",
            "sha256": sha256,
            "opset": OPSET,
            "input": {
                "name": "images",
                "shape": [1, 3, INPUT, INPUT],
                "dtype": "float32",
                "layout": "NCHW",
                "color_order": "RGB",
            },
            "preprocess": {
                "resize": {
                    "width": INPUT,
                    "height": INPUT,
                    "interpolation": "area",
                    "mode": "letterbox",
                },
                "scale": 1 / 255,
                "mean": [0.0, 0.0, 0.0],
                "std": [1.0, 1.0, 1.0],
            },
            "labels": list(LABELS),
            "postprocess": {
                "kind": "detection",
                "layout": "yolov8",
                "outputs": ["output0"],
                "score_threshold": score_threshold,
                "iou_threshold": 0.45,
                "max_detections": 100,
            },
        }
    )


Sample = tuple[U8, F32, npt.NDArray[np.int64]]  # input levels, boxes, labels
SCALE = np.float32(1 / 255)  # the manifest's scale, as the serving blob applies it


def image(
    seed: int, stream: int, index: int
) -> tuple[bytes, tuple[synth_boxes.Defect, ...], tuple[int, int]]:
    """One JPEG (quality 60-98), its defects and its size, fully determined by (seed,
    stream, index)."""
    rng = np.random.default_rng([seed, stream, index])
    width, height = SIZES[int(rng.integers(len(SIZES)))]
    img, defects = synth_boxes.generate(rng, width=width, height=height)
    return synth_boxes.encode_jpeg(img, int(rng.integers(60, 99))), defects, (width, height)


def _sample(args: tuple[int, int, int]) -> Sample:
    """A training input as the serving code makes it, boxes mapped into input pixels."""
    data, defects, _ = image(*args)
    batch, _, _, frame = LoadedModel(manifest(), session=None).prepare(data)
    # With scale 1/255 and mean 0 the tensor is uint8 levels times SCALE: kept as the
    # levels (a quarter of the memory), once the round trip is checked to be bit-exact.
    levels = np.rint(batch[0] / SCALE).astype(np.uint8)
    if not np.array_equal(levels * SCALE, batch[0]):
        raise SystemExit("the input tensor is not uint8 levels times 1/255: preprocessing changed?")
    boxes = np.array([d.box for d in defects], np.float32).reshape(-1, 4)
    # input = image * scale + pad (sluicegate.vision.geometry.Frame)
    boxes = boxes * np.array([frame.scale_x, frame.scale_y] * 2, np.float32)
    boxes += np.array([frame.pad_x, frame.pad_y] * 2, np.float32)
    labels = np.array([LABELS.index(d.label) for d in defects], np.int64)
    return levels, boxes, labels


def dataset(
    seed: int, stream: int, n: int, jobs: int
) -> tuple[U8, list[F32], list[npt.NDArray[np.int64]]]:
    """``n`` inputs as uint8 levels, and their boxes (input pixels) and labels."""
    x = np.empty((n, 3, INPUT, INPUT), np.uint8)
    boxes, labels = [], []
    tasks = [(seed, stream, i) for i in range(n)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for i, (levels, b, c) in enumerate(pool.imap(_sample, tasks, chunksize=32)):
            x[i] = levels
            boxes.append(b)
            labels.append(c)
    return x, boxes, labels


# --- held-out evaluation through the production path -------------------------------------


def evaluate(folder: Path, seed: int, n: int) -> float:
    """mAP@0.5 on ``n`` fresh images (a stream training never saw) via infer_bytes, at the
    manifest's score threshold and at 0.05; and the time infer_bytes takes."""
    model = ModelRegistry.from_dir(folder).get(NAME)
    loose = LoadedModel(manifest(model.manifest.sha256, 0.05), model.session)
    predictions: list[list[Prediction]] = []
    loose_predictions: list[list[Prediction]] = []
    truths: list[list[Truth]] = []
    stages = []
    for i in range(n):
        data, defects, (width, height) = image(seed, HELDOUT_STREAM, i)
        outputs, times = model.infer_bytes(data)
        predictions.append([(d.label, d.score, d.box) for d in outputs.detections])
        wide, _ = loose.infer_bytes(data)
        loose_predictions.append([(d.label, d.score, d.box) for d in wide.detections])
        size = np.array([width, height] * 2, np.float64)
        truths.append([(d.label, _four(np.array(d.box) / size)) for d in defects])
        stages.append(times)
    score = mean_average_precision(predictions, truths, labels=LABELS)
    print(
        f"held-out mAP@0.5 on {n} fresh JPEGs (sizes and qualities as in training) via "
        f"LoadedModel.infer_bytes, score threshold {SCORE_THRESHOLD}: {score.mean_ap:.4f}"
    )
    for c in score.per_class:
        print(
            f"  {c.label:>8}: AP {c.ap or 0.0:.4f}; {c.truths} defects, {c.predictions} "
            f"detections, precision {c.true_positives / max(1, c.predictions):.3f}, "
            f"recall {c.true_positives / max(1, c.truths):.3f}"
        )
    wide_score = mean_average_precision(loose_predictions, truths, labels=LABELS)
    per_class = ", ".join(f"{c.label} {c.ap or 0.0:.4f}" for c in wide_score.per_class)
    print(f"  at score threshold 0.05: mAP@0.5 {wide_score.mean_ap:.4f} ({per_class})")
    med = statistics.median
    total = [t.total_ms for t in stages]
    print(
        f"  one run per image, median (p50): infer_bytes {med(total):.2f} ms (decode "
        f"{med(t.decode_ms for t in stages):.2f}, preprocess "
        f"{med(t.preprocess_ms for t in stages):.2f}, run + postprocess "
        f"{med(t.inference_ms for t in stages):.2f}); p90 {np.percentile(total, 90):.2f} ms; "
        "one ONNX Runtime thread"
    )
    best = []
    for i in range(20):
        data, _, _ = image(seed, HELDOUT_STREAM, i)
        best.append(min(model.infer_bytes(data)[1].total_ms for _ in range(20)))
    print(f"  best of 20 runs per image, median over 20 images: {med(best):.2f} ms")
    return score.mean_ap


def _four(box: npt.NDArray[np.float64]) -> tuple[float, float, float, float]:
    x1, y1, x2, y2 = (float(v) for v in box)
    return x1, y1, x2, y2
