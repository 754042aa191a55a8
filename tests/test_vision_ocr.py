"""OCR: the pure steps as tables (CTC decoding, the detector's size, DB boxes, crops, the
recogniser's batch), then the served PP-OCRv4 model (real weights, real ONNX Runtime) on
three fixed label images, in a pool worker's batch, and refusing files that do not match."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

from center_pool.execution import run_batch
from sluicegate import wire
from sluicegate.errors import ModelIntegrityError
from sluicegate.vision import label_synth, synth
from sluicegate.vision.image import PayloadLimits, probe
from sluicegate.vision.ocr import crop, ctc_greedy, detector_size, recogniser_batch, text_boxes
from sluicegate.vision.runtime import ModelRegistry, OcrModel, default_models_dir

CHARSET = ("A", "B", "C", "-")


def _probs(steps: list[int], classes: int = 5, p: float = 0.9) -> np.ndarray:
    out = np.full((1, len(steps), classes), (1 - p) / (classes - 1), np.float32)
    for t, c in enumerate(steps):
        out[0, t, c] = p
    return out


@pytest.mark.parametrize(
    ("steps", "text"),
    [
        ([1, 1, 0, 1, 2, 2, 3], "AABC"),  # a blank between two As keeps both
        ([0, 0, 0], ""),
        ([4, 4, 4, 0, 2], "-B"),
        ([3], "C"),
    ],
)
def test_ctc_greedy_merges_repeats_and_drops_blanks(steps: list[int], text: str) -> None:
    ((got, confidence),) = ctc_greedy(_probs(steps), CHARSET)
    assert got == text
    assert confidence == pytest.approx(0.9 if text else 0.0)


def test_ctc_greedy_refuses_an_output_of_another_character_set() -> None:
    with pytest.raises(ValueError, match=r"expected \[N, T, 5\] \(blank \+ 4 characters\)"):
        ctc_greedy(np.zeros((1, 3, 7), np.float32), CHARSET)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((320, 160), (640, 320)),  # a small label: scaled up to a 320-pixel short side
        ((1920, 1080), (960, 544)),  # a camera frame: scaled down to a 960-pixel long side
        ((700, 500), (704, 512)),  # in between: only rounded to 32
        ((4000, 40), (3200, 32)),  # a long strip: the short side never below 32, first
    ],
)
def test_detector_size(size: tuple[int, int], expected: tuple[int, int]) -> None:
    assert (
        detector_size(*size, max_side=960, min_side=320 if size == (320, 160) else 32) == expected
    )


def test_db_boxes_are_grown_scaled_to_the_image_and_in_reading_order() -> None:
    prob = np.zeros((64, 128), np.float32)
    prob[40:50, 10:60] = 0.9  # second line
    prob[10:20, 70:120] = 0.9  # first line, right
    prob[12:18, 5:40] = 0.8  # first line, left
    prob[30:32, 100:101] = 0.9  # a speck: too small
    prob[55:62, 80:120] = 0.35  # over the threshold but a weak box: dropped
    found = text_boxes(prob, (256, 128), box_threshold=0.5, unclip_ratio=1.5)
    boxes = [quad for quad, _ in found]
    assert len(boxes) == 3
    lefts = [float(q[0, 0]) for q in boxes]
    tops = [float(q[0, 1]) for q in boxes]
    assert lefts[0] < lefts[1]  # the first line left to right ...
    assert tops[2] > tops[1]  # ... then the line below
    # The 50x10 blob (dilated to 51x11) grows by area x 1.5 / perimeter = 6.8 px a side,
    # then doubles to image pixels.
    second = boxes[2]
    width = float(np.linalg.norm(second[1] - second[0]))
    height = float(np.linalg.norm(second[3] - second[0]))
    assert width == pytest.approx(2 * (50 + 2 * 6.8), abs=4)
    assert height == pytest.approx(2 * (10 + 2 * 6.8), abs=4)
    # Each box's mean probability (its dilated rim is 0): over box_threshold, under the peak.
    assert all(0.5 <= s < 0.9 for _, s in found)


def test_a_crop_is_upright_and_a_tall_one_turned() -> None:
    image = np.zeros((100, 200, 3), np.uint8)
    image[20:40, 50:150] = 255
    quad = np.array([[50, 20], [150, 20], [150, 40], [50, 40]], np.float32)
    assert crop(image, quad).shape == (20, 100, 3)
    tall = np.array([[10, 10], [30, 10], [30, 90], [10, 90]], np.float32)
    assert crop(image, tall).shape == (20, 80, 3)


def test_the_recogniser_batch_keeps_aspect_and_pads_to_the_widest() -> None:
    crops = [np.full((24, 96, 3), 255, np.uint8), np.full((48, 480, 3), 0, np.uint8)]
    batch = recogniser_batch(crops, height=48, min_width=320)
    assert batch.shape == (2, 3, 48, 480)
    assert np.allclose(batch[0, :, :, :192], 1.0)  # white is +1, scaled to 192 wide
    assert np.allclose(batch[0, :, :, 192:], 0.0)  # then padding
    assert np.allclose(batch[1], -1.0)


# -- the served model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ocr() -> OcrModel:
    model = ModelRegistry.from_dir(default_models_dir()).get("ocr-ppocrv4")
    assert isinstance(model, OcrModel)
    return model


def _label(seed: int) -> label_synth.Label:
    return label_synth.generate_label(np.random.default_rng(seed))


FIXED = {  # seed -> the text read, line by line (the recogniser reads most spaces as none)
    5: ["SNA3RS-62902"],
    11: ["SN3RUV-70414", "P/N934-5929"],
    23: ["SN PWJE-61166"],
}


@pytest.mark.parametrize("seed", sorted(FIXED))
def test_the_text_on_three_fixed_labels(ocr: OcrModel, seed: int) -> None:
    label = _label(seed)
    outputs, _times = ocr.infer_bytes(synth.encode_jpeg(label.image))
    assert [line.text for line in outputs.texts] == FIXED[seed]
    assert [line.replace(" ", "") for line in label.lines] == [
        text.replace(" ", "") for text in FIXED[seed]
    ]
    for line in outputs.texts:
        assert line.score > 0.9
        x1, y1, x2, y2 = line.box
        assert 0.0 <= x1 < x2 <= 1.0
        assert 0.0 <= y1 < y2 <= 1.0
        assert len(line.quad) == 4
    document = wire.outputs_of(outputs).model_dump()
    assert [t["text"] for t in document["texts"]] == FIXED[seed]


def test_a_surface_without_a_label_reads_no_text(ocr: OcrModel) -> None:
    image, _ = synth.generate(np.random.default_rng(2), "ok", width=320, height=160)
    outputs, _times = ocr.infer_bytes(synth.encode_jpeg(image))
    assert outputs.texts == ()


def test_a_pool_batch_of_labels_is_read_one_image_at_a_time(ocr: OcrModel) -> None:
    jobs = []
    for seed in (5, 23):
        data = synth.encode_jpeg(_label(seed).image)
        jobs.append((data, probe(data)))
    limits = PayloadLimits(max_payload_bytes=1 << 20, max_pixels=1 << 22, max_side=4096)
    run = run_batch(ocr, jobs, limits=limits)
    assert [[t.text for t in item.outputs.texts] for item in run.items if item.outputs] == [
        FIXED[5],
        FIXED[23],
    ]
    assert run.batch_size == 2


def _staged(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    source = default_models_dir()
    for name in ("ocr-ppocrv4.json", "ocr-ppocrv4-det.onnx", "ocr-ppocrv4-rec.onnx"):
        shutil.copy(source / name, folder / name)
    return folder


def test_a_recogniser_that_does_not_match_its_pinned_digest_is_refused(tmp_path: Path) -> None:
    folder = _staged(tmp_path)
    rec = folder / "ocr-ppocrv4-rec.onnx"
    rec.write_bytes(rec.read_bytes() + b"\0")
    with pytest.raises(
        ModelIntegrityError, match=r"ocr-ppocrv4-rec.onnx does not match its manifest"
    ):
        ModelRegistry.from_dir(folder)
    rec.unlink()
    with pytest.raises(
        ModelIntegrityError, match=r"ocr-ppocrv4-rec.onnx named by .* cannot be read"
    ):
        ModelRegistry.from_dir(folder)


def test_a_recogniser_output_that_is_not_its_character_set_is_refused(tmp_path: Path) -> None:
    folder = _staged(tmp_path)
    manifest = folder / "ocr-ppocrv4.json"
    doc = json.loads(manifest.read_text())
    doc["postprocess"]["recognizer"]["output"] = "logits"
    manifest.write_text(json.dumps(doc))
    with pytest.raises(
        ModelIntegrityError, match=r"recogniser output 'logits' must be \[N, T, 6625\]"
    ):
        ModelRegistry.from_dir(folder)


def test_a_label_image_is_a_jpeg_a_camera_would_send() -> None:
    label = _label(5)
    assert label.image.shape == (160, 320, 3)
    assert label.lines == ("SN A3RS-62902",)
    decoded = cv2.imdecode(np.frombuffer(synth.encode_jpeg(label.image), np.uint8), 1)
    assert decoded.shape == label.image.shape
