"""``sluicegate models add``: graphs of each detector layout, built here with onnx.helper,
are installed with a manifest that serves them (real ONNX Runtime, real sha256), and graphs
that fit no kind are refused naming the tensor, leaving the models folder as it was."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from center_pool.execution import run_batch
from sluicegate.app.cli import app
from sluicegate.vision import synth
from sluicegate.vision.image import PayloadLimits as Limits
from sluicegate.vision.image import probe
from sluicegate.vision.priors import PRIORS_FILE
from sluicegate.vision.runtime import ModelRegistry

SIZE = 64
NAMES = "{0: 'scratch', 1: 'pit', 2: 'stain'}"  # as Ultralytics writes them


def graph(
    path: Path,
    tail: tuple[int, ...],
    bias: np.ndarray,
    *,
    input_shape: list[int | str] | None = None,
    input_type: int = TensorProto.FLOAT,
    output: str = "output0",
    names: str | None = NAMES,
    opset: int = 17,
) -> Path:
    """A graph whose one output [N, *tail] is ``bias`` whatever the image (its weights are
    zero): the image is pooled to three numbers, multiplied by zeros, shaped and biased."""
    flat = int(np.prod(tail))
    nodes = [
        helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["mixed"]),
        helper.make_node("Reshape", ["mixed", "shape"], ["shaped"]),
        helper.make_node("Add", ["shaped", "bias"], [output]),
    ]
    inits = [
        numpy_helper.from_array(np.zeros((3, flat), np.float32), "w"),
        numpy_helper.from_array(np.array([-1, *tail], np.int64), "shape"),
        numpy_helper.from_array(bias.reshape(1, *tail).astype(np.float32), "bias"),
    ]
    shape = input_shape or ["batch", 3, SIZE, SIZE]
    g = helper.make_graph(
        nodes,
        "brought",
        [helper.make_tensor_value_info("images", input_type, shape)],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", *tail])],
        inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    if names is not None:
        helper.set_model_props(model, {"names": names})
    onnx.save(model, path)
    return path


def yolov8_bias() -> np.ndarray:
    out = np.zeros((7, 30), np.float32)  # 4 box rows + 3 labels, 30 anchors
    out[:4, 0] = (32, 32, 16, 16)  # a centred 16x16 box ...
    out[5, 0] = 0.9  # ... of a pit
    return out


def yolov5_bias() -> np.ndarray:
    out = np.zeros((30, 8), np.float32)
    out[0, :6] = (32, 32, 16, 16, 1.0, 0.0)
    out[0, 7] = 0.8  # a stain
    return out


def nms_bias() -> np.ndarray:
    out = np.zeros((10, 6), np.float32)
    out[0] = (24, 24, 40, 40, 0.7, 0)  # a scratch; the other rows are padding
    return out


def add(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["models", "add", *args])
    return result.exit_code, result.output


def add_classifier(source: Path, folder: Path, labels: str, *extra: str) -> tuple[int, str]:
    """``models add`` of classifier ``source`` with ``labels`` (a labels file's text) into
    ``folder/models``."""
    path = folder / "labels.txt"
    path.write_text(labels)
    models = str(folder / "models")
    return add(str(source), "--kind", "classification", "--labels", str(path), *extra,
               "--models-dir", models)  # fmt: skip


def jpeg(width: int, height: int) -> bytes:
    image, _ = synth.generate(np.random.default_rng(3), "ok", width=width, height=height)
    return synth.encode_jpeg(image)


@pytest.mark.parametrize(
    ("kind", "tail", "bias", "expected"),
    [
        ("yolov8", (7, 30), yolov8_bias(), ("pit", 0.9, (0.375, 0.25, 0.625, 0.75))),
        ("yolov5", (30, 8), yolov5_bias(), ("stain", 0.8, (0.375, 0.25, 0.625, 0.75))),
        ("nms", (10, 6), nms_bias(), ("scratch", 0.7, (0.375, 0.25, 0.625, 0.75))),
    ],
)
def test_a_detector_of_each_layout_is_added_and_served(
    tmp_path: Path,
    kind: str,
    tail: tuple[int, ...],
    bias: np.ndarray,
    expected: tuple[str, float, tuple[float, ...]],
) -> None:
    source = graph(tmp_path / "det.onnx", tail, bias)
    models = tmp_path / "models"
    code, out = add(str(source), "--kind", kind, "--name", "brought", "--models-dir", str(models))
    assert code == 0, out
    assert "added brought v1.0.0" in out
    assert "sample image: 1 detection(s)" in out
    doc = json.loads((models / "brought.json").read_text())
    assert doc["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert doc["labels"] == ["scratch", "pit", "stain"]  # from the export's metadata
    assert doc["postprocess"]["layout"] == kind
    assert doc["preprocess"]["resize"]["mode"] == "letterbox"
    # Served the way every node serves it: a 128x64 image is letterboxed into 64x64 (placed
    # 64x32 at y = 16), and the box (24..40 on both axes of the input) comes back on the
    # original image: x 48..80 of 128, y 16..48 of 64.
    model = ModelRegistry.from_dir(models).get("brought")
    outputs, _times = model.infer_bytes(jpeg(128, 64))
    ((label, score, box),) = [(d.label, d.score, d.box) for d in outputs.detections]
    assert (label, round(score, 4)) == expected[:2]
    assert box == pytest.approx(expected[2], abs=1e-6)


def test_a_model_with_its_batch_fixed_at_one_is_benched_and_served_an_image_at_a_time(
    tmp_path: Path,
) -> None:
    # A third-party export whose graph says batch 1: timed by 'models bench' and served by
    # a pool worker's batches one image per run (ONNX Runtime refuses 2 where 1 is fixed).
    source = graph(
        tmp_path / "fixed.onnx",
        (4,),
        np.array([0.1, 0.2, 0.6, 0.1]),
        input_shape=[1, 3, SIZE, SIZE],
        names=None,
    )
    models = tmp_path / "models"
    code, out = add_classifier(source, tmp_path, "ok\nscratch\npit\nstain\n")
    assert code == 0, out
    benched = CliRunner().invoke(
        app, ["models", "bench", "--models-dir", str(models), "--runs", "3", "--batch", "4"]
    )
    assert benched.exit_code == 0, (benched.output, benched.exception)
    priors = json.loads((models / PRIORS_FILE).read_text())["priors"]
    assert {(p["model"], p["batch"]) for p in priors} == {("fixed", 1)}
    model = ModelRegistry.from_dir(models).get("fixed")
    assert (model.fixed_batch, model.batchable) == (1, False)
    images = [jpeg(96, 64), jpeg(64, 64), jpeg(128, 96)]
    limits = Limits(max_payload_bytes=1 << 20, max_pixels=1 << 20, max_side=4096)
    run = run_batch(model, [(i, probe(i)) for i in images], limits=limits)
    assert [(item.ok, item.outputs.label if item.outputs else None) for item in run.items] == [
        (True, "pit")
    ] * 3
    tensors = [model.prepare(i)[0] for i in images]  # a batch handed over whole: run apart
    assert [o.label for o in model.run(np.concatenate(tensors))] == ["pit"] * 3


def test_a_classifier_with_labels_from_a_file(tmp_path: Path) -> None:
    source = graph(tmp_path / "cls.onnx", (4,), np.array([0.1, 0.2, 0.6, 0.1]), names=None)
    labels = "# defect classes\nok\nscratch\n\npit\nstain\n"
    models = tmp_path / "models"
    code, out = add_classifier(source, tmp_path, labels)
    assert code == 0, out
    assert "sample image: label pit" in out
    model = ModelRegistry.from_dir(models).get("cls")
    assert model.manifest.labels == ("ok", "scratch", "pit", "stain")
    assert model.manifest.preprocess.resize.mode == "stretch"


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (
            lambda p: graph(p, (84, 30), np.zeros((84, 30))),  # an 80-class export
            ["--kind", "yolov8"],
            r"output 'output0' has shape \[\?, 84, 30\] \(axis 1: 84\); a yolov8 graph of 3 "
            r"labels has \[N, 7, A\]",
        ),
        (
            lambda p: graph(p, (7, 30), yolov8_bias()),
            ["--kind", "yolov5"],
            r"a yolov5 graph of 3 labels has \[N, A, 8\]",
        ),
        (
            lambda p: graph(p, (2,), np.zeros(2), names="['good', 'anomalous']"),
            ["--kind", "anomaly"],
            r"no output is an anomaly map \[N, 1, H, W\] or \[N, H, W\]; the graph has "
            r"output0 \[\?, 2\]",
        ),
        (
            lambda p: graph(p, (1, 8, 8), np.zeros((1, 8, 8))),
            ["--kind", "anomaly"],
            "an anomaly model has two labels, normal then anomalous",
        ),
        (
            lambda p: graph(p, (7, 30), yolov8_bias(), input_type=TensorProto.UINT8),
            ["--kind", "yolov8"],
            "input 'images' is uint8; a float32 image tensor is served",
        ),
        (
            lambda p: graph(p, (7, 30), yolov8_bias(), input_shape=["b", 3, "h", "w"]),
            ["--kind", "yolov8"],
            r"input 'images' has shape \[\?, 3, \?, \?\]: its size is left open; give --size",
        ),
        (
            lambda p: graph(p, (7, 30), yolov8_bias(), input_shape=[4, 3, SIZE, SIZE]),
            ["--kind", "yolov8"],
            "has a fixed batch of 4",
        ),
        (
            lambda p: graph(p, (7, 30), yolov8_bias(), names=None),
            ["--kind", "yolov8"],
            "no labels: give --labels FILE",
        ),
        (
            lambda p: graph(p, (7, 30), yolov8_bias(), opset=6),
            ["--kind", "yolov8"],
            "operator set 6; ONNX Runtime needs 7 or newer",
        ),
        (
            lambda p: (p.write_bytes(b"not a model at all"), p)[1],
            ["--kind", "yolov8"],
            "is not an ONNX model",
        ),
        (
            lambda p: graph(p, (7, 30), yolov8_bias()),
            ["--kind", "ssd"],
            "--kind 'ssd': expected one of classification, yolov8, yolov5, yolox, nms, anomaly",
        ),
    ],
)
def test_a_graph_that_fits_no_kind_is_refused_and_nothing_is_installed(
    tmp_path: Path, make: object, args: list[str], message: str
) -> None:
    source = make(tmp_path / "m.onnx")  # type: ignore[operator]
    models = tmp_path / "models"
    models.mkdir()
    code, out = add(str(source), *args, "--models-dir", str(models))
    assert code == 2
    assert "error:" in out
    assert re.search(message, " ".join(out.split())), out
    assert list(models.iterdir()) == []


def test_an_open_input_size_is_served_at_the_size_given(tmp_path: Path) -> None:
    source = graph(tmp_path / "open.onnx", (7, 30), yolov8_bias(), input_shape=["b", 3, "h", "w"])
    models = tmp_path / "models"
    code, out = add(str(source), "--kind", "yolov8", "--size", "64x64", "--models-dir", str(models))
    assert code == 0, out
    assert ModelRegistry.from_dir(models).get("open").manifest.input.shape == (1, 3, 64, 64)
    code, out = add(
        str(source), "--kind", "yolov8", "--size", "64by64", "--models-dir", str(models)
    )
    assert code == 2
    assert "expected WIDTHxHEIGHT" in out


def test_a_name_already_served_is_replaced_only_when_asked(tmp_path: Path) -> None:
    models = tmp_path / "models"
    first = graph(tmp_path / "a.onnx", (7, 30), yolov8_bias())
    second = graph(tmp_path / "b.onnx", (30, 8), yolov5_bias())
    assert add(str(first), "--kind", "yolov8", "--name", "det", "--models-dir", str(models))[0] == 0
    code, out = add(str(second), "--kind", "yolov5", "--name", "det", "--models-dir", str(models))
    assert code == 2
    assert "exists already; give another --name, or --replace" in " ".join(out.split())
    code, out = add(
        str(second), "--kind", "yolov5", "--name", "det", "--version", "2.0.0",
        "--models-dir", str(models), "--replace",
    )  # fmt: skip
    assert code == 0, out
    served = ModelRegistry.from_dir(models).get("det").manifest
    assert (served.version, served.sha256) == (
        "2.0.0",
        hashlib.sha256(second.read_bytes()).hexdigest(),
    )


def test_an_anomaly_model_is_added_and_its_regions_come_back(tmp_path: Path) -> None:
    amap = np.zeros((1, 8, 8), np.float32)
    amap[0, 2:4, 4:8] = 0.9  # the right half of rows 2 and 3
    source = graph(tmp_path / "padim.onnx", (1, 8, 8), amap, names="['good', 'anomalous']")
    models = tmp_path / "models"
    code, out = add(str(source), "--kind", "anomaly", "--models-dir", str(models))
    assert code == 0, out
    assert "sample image: label anomalous" in out
    model = ModelRegistry.from_dir(models).get("padim")
    assert model.manifest.preprocess.resize.mode == "stretch"
    outputs, _times = model.infer_bytes(jpeg(128, 64))
    assert outputs.label == "anomalous"
    ((box, area),) = [(r.box, r.area) for r in outputs.regions]
    assert box == pytest.approx((0.5, 0.25, 1.0, 0.5))
    assert area == pytest.approx(8 / 64)


def _with_metadata(path: Path, props: dict[str, str]) -> Path:
    model = onnx.load(path)
    helper.set_model_props(model, props)
    onnx.save(model, path)
    return path


def test_a_bgr_model_gets_the_default_mean_and_std_in_its_own_channel_order(
    tmp_path: Path,
) -> None:
    source = graph(tmp_path / "cls.onnx", (4,), np.array([0.1, 0.2, 0.6, 0.1]), names=None)
    models = tmp_path / "models"
    code, out = add_classifier(source, tmp_path, "ok\nscratch\npit\nstain\n", "--bgr")
    assert code == 0, out
    doc = json.loads((models / "cls.json").read_text())
    assert doc["input"]["color_order"] == "BGR"
    assert doc["preprocess"]["mean"] == [0.406, 0.456, 0.485]  # ImageNet's, B G R
    assert doc["preprocess"]["std"] == [0.225, 0.224, 0.229]


def test_raw_pixels_a_score_threshold_and_a_replacement_that_keeps_them(tmp_path: Path) -> None:
    # A detector trained on raw 0-255 pixels with a low threshold (ddddocr's kind): given
    # once, edited by hand, kept by the next version installed with --replace.
    models = tmp_path / "models"
    empty = np.zeros((7, 30), np.float32)  # finds nothing on any image
    source = graph(tmp_path / "det.onnx", (7, 30), empty)
    code, out = add(
        str(source), "--kind", "yolov8", "--name", "det", "--scale", "1", "--mean", "10,20,30",
        "--score-threshold", "0.05", "--models-dir", str(models),
    )  # fmt: skip
    assert code == 0, out
    assert "sample image: 0 detection(s)" in out  # not "label None"
    manifest = models / "det.json"
    doc = json.loads(manifest.read_text())
    assert (doc["preprocess"]["scale"], doc["preprocess"]["mean"]) == (1.0, [10.0, 20.0, 30.0])
    assert doc["postprocess"]["score_threshold"] == 0.05
    doc["preprocess"]["resize"]["pad_value"] = 0  # the operator's own edit
    manifest.write_text(json.dumps(doc))
    newer = graph(tmp_path / "det2.onnx", (7, 30), yolov8_bias())
    code, out = add(
        str(newer), "--kind", "yolov8", "--name", "det", "--version", "1.1.0", "--replace",
        "--std", "2,2,2", "--models-dir", str(models),
    )  # fmt: skip
    assert code == 0, out
    kept = out.split("kept from the manifest it replaced: ")[1].split()
    assert {k.strip(",") for k in kept} >= {"scale", "mean", "pad_value", "score_threshold"}
    again = json.loads(manifest.read_text())
    assert again["version"] == "1.1.0"
    assert again["preprocess"]["scale"] == 1.0
    assert again["preprocess"]["mean"] == [10.0, 20.0, 30.0]
    assert again["preprocess"]["std"] == [2.0, 2.0, 2.0]  # given again: the new value
    assert again["preprocess"]["resize"]["pad_value"] == 0
    assert again["postprocess"]["score_threshold"] == 0.05
    code, out = add(str(newer), "--kind", "yolov8", "--mean", "1,2", "--models-dir", str(models))
    assert code == 2
    assert "--mean '1,2': give three numbers" in out


@pytest.mark.parametrize(
    ("props", "labels"),
    [
        ({"classes": '["ok", "scratch", "pit", "stain"]'}, ["ok", "scratch", "pit", "stain"]),
        ({"labels": "ok, scratch, pit, stain"}, ["ok", "scratch", "pit", "stain"]),
        ({"class_names": '{"0": "ok", "1": "scratch", "2": "pit", "3": "stain"}'},
         ["ok", "scratch", "pit", "stain"]),
    ],
)  # fmt: skip
def test_class_names_are_read_from_the_metadata_keys_exporters_use(
    tmp_path: Path, props: dict[str, str], labels: list[str]
) -> None:
    source = graph(tmp_path / "cls.onnx", (4,), np.array([0.1, 0.2, 0.6, 0.1]), names=None)
    _with_metadata(source, props)
    models = tmp_path / "models"
    code, out = add(str(source), "--kind", "classification", "--models-dir", str(models))
    assert code == 0, out
    assert json.loads((models / "cls.json").read_text())["labels"] == labels
    assert "sample image: label pit" in out
