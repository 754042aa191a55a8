"""Benchmark: how well and how fast the served OCR model (``ocr-ppocrv4``: PP-OCRv4 text
detection and recognition, :mod:`sluicegate.vision.ocr_model`) reads serial-number labels.

``--images`` labels come from :mod:`sluicegate.vision.label_synth` (a sticker on a machined
surface, one of OpenCV's Hershey fonts, slight perspective and rotation, uneven light, blur,
noise), JPEG-encoded as a camera would send them, each read through the one path every node
uses (``LoadedModel.infer_bytes``). Accuracy is exact-string: every printed line read, in
order, nothing else. It is given twice: as printed, and with spaces ignored (the recogniser
was trained mostly on Chinese text and reads ``SN 7K4Q-20931`` as ``SN7K4Q-20931``). The
baseline beside it, on the same images, is the two ONNX sessions alone (detector on the
same input, recogniser on the same crops), so the rest is what the pipeline's own steps cost.

    .venv/bin/python bench/ocr_accuracy.py                 # 1,000 labels, about 90 s on 2 cores
    .venv/bin/python bench/ocr_accuracy.py --images 200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from sluicegate.vision import label_synth, synth  # noqa: E402
from sluicegate.vision.ocr import crop, recogniser_batch, text_boxes  # noqa: E402
from sluicegate.vision.runtime import ModelRegistry, OcrModel, default_models_dir  # noqa: E402

TARGET = {"exact_spaces_ignored": 0.95}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    model = ModelRegistry.from_dir(default_models_dir()).get("ocr-ppocrv4")
    assert isinstance(model, OcrModel)
    rng = np.random.default_rng(args.seed)
    exact = loose = chars_wrong = chars_total = 0
    served: list[float] = []
    bare: list[float] = []
    misses: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    for i in range(args.images + args.warmup):
        label = label_synth.generate_label(rng)
        data = synth.encode_jpeg(label.image)
        t0 = time.perf_counter()
        outputs, _times = model.infer_bytes(data)
        t1 = time.perf_counter()
        sessions_ms = _sessions_only(model, data)
        if i < args.warmup:
            continue
        served.append((t1 - t0) * 1e3)
        bare.append(sessions_ms)
        read = tuple(t.text for t in outputs.texts)
        exact += read == label.lines
        squeezed = tuple(s.replace(" ", "") for s in label.lines)
        read_squeezed = tuple(s.replace(" ", "") for s in read)
        loose += read_squeezed == squeezed
        if read_squeezed != squeezed and len(misses) < 10:
            misses.append((label.lines, read))
        truth, got = "".join(squeezed), "".join(read_squeezed)
        chars_total += len(truth)
        chars_wrong += sum(a != b for a, b in zip(truth, got, strict=False)) + abs(
            len(truth) - len(got)
        )
    n = len(served)
    subject = {
        "exact": stats.ratio(exact, n),
        "exact_spaces_ignored": stats.ratio(loose, n),
        "char_error_rate": chars_wrong / max(1, chars_total),
        "p50_ms": stats.percentile(served, 50),
        "p99_ms": stats.percentile(served, 99),
    }
    baseline = {
        "sessions_p50_ms": stats.percentile(bare, 50),
        "sessions_p99_ms": stats.percentile(bare, 99),
    }
    print(f"OCR on {n} synthetic serial-number labels (320x160 JPEG), one thread")
    print(f"  exact, as printed          {subject['exact']:.3f}")
    print(f"  exact, spaces ignored      {subject['exact_spaces_ignored']:.3f}   (target >= 0.95)")
    print(f"  character error rate       {subject['char_error_rate']:.4f}")
    print(f"  served p50 / p99           {subject['p50_ms']:.1f} / {subject['p99_ms']:.1f} ms")
    alone = baseline["sessions_p50_ms"], baseline["sessions_p99_ms"]
    print(f"  sessions alone p50 / p99   {alone[0]:.1f} / {alone[1]:.1f} ms")
    for printed, read in misses:
        print(f"  missed: printed {printed}, read {read}")
    result = {
        "bench": "ocr_accuracy",
        "subject": subject,
        "baseline": baseline,
        "ratio": {
            "served_over_sessions_p50": stats.ratio(subject["p50_ms"], baseline["sessions_p50_ms"])
        },
        "target": TARGET,
        "met": stats.met(subject, TARGET, most=()),
        "measured": stats.require(
            {"labels read": n, "labels read by the bare sessions": len(bare)}
        ),
        "machine": stats.machine(),
        "images": n,
        "seed": args.seed,
    }
    print(stats.result_line(result))


def _sessions_only(model: OcrModel, data: bytes) -> float:
    """The detector and the recogniser alone on this image's input and crops."""
    tensor, _d, _p, frame = model.prepare(data)
    post = model.manifest.postprocess
    rec = post.recognizer  # type: ignore[union-attr]
    t0 = time.perf_counter()
    (prob,) = model.session.run([post.output], {model.manifest.input.name: tensor})  # type: ignore[union-attr]
    spent = time.perf_counter() - t0
    found = text_boxes(prob[0, 0], (frame.width, frame.height))
    if found:
        crops = [crop(frame.image, quad) for quad, _ in found]  # type: ignore[attr-defined]
        batch = recogniser_batch(crops, height=rec.height, min_width=rec.min_width)
        t1 = time.perf_counter()
        model.recogniser.run([rec.output], {rec.input: batch})
        spent += time.perf_counter() - t1
    return spent * 1e3


if __name__ == "__main__":
    main()
