"""Writing a manifest for a model someone brings: which kind of model the graph is, and
whether its tensors fit that kind, decided from the graph's declared facts alone.

:func:`manifest_for` takes what :func:`sluicegate.vision.graph.read_graph` read, the kind
the user names and the labels, and returns the manifest as a document, or raises
:class:`ModelRefused` saying which tensor does not fit and why. Pure: no file, no runtime.
Defaults follow the exporters: YOLO graphs take an RGB letterbox scaled to ``[0, 1]``
(pad 114), classification and anomaly graphs a stretched RGB image with ImageNet's mean and
standard deviation (in BGR order for a BGR model: they follow the input's channels), unless
the user says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sluicegate.errors import ModelError
from sluicegate.vision.graph import GraphFacts, Tensor

__all__ = ["KINDS", "Authoring", "ModelRefused", "manifest_for"]

Kind = Literal["classification", "yolov8", "yolov5", "yolox", "nms", "anomaly"]
KINDS: tuple[Kind, ...] = ("classification", "yolov8", "yolov5", "yolox", "nms", "anomaly")
MIN_OPSET = 7  # the oldest operator set ONNX Runtime still runs
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


class ModelRefused(ModelError):
    """A graph does not fit the kind of model it was said to be."""


@dataclass(frozen=True)
class Authoring:
    """What the user says about the model besides its graph."""

    name: str
    version: str
    file: str
    sha256: str
    kind: Kind
    labels: tuple[str, ...]
    size: tuple[int, int] | None = None  # width, height, for an input the graph leaves open
    # None: not said (the kind's default, or the replaced manifest's with --replace).
    color_order: Literal["RGB", "BGR"] | None = None
    scale: float | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    score_threshold: float | None = None


def manifest_for(facts: GraphFacts, how: Authoring) -> dict[str, Any]:
    """The manifest document for the graph, or ModelRefused naming the misfit."""
    if facts.opset < MIN_OPSET:
        raise ModelRefused(
            f"the graph uses operator set {facts.opset}; ONNX Runtime needs {MIN_OPSET} or "
            "newer: export it again with a newer opset"
        )
    image = _image_input(facts, how)
    width, height = _size(image, how)
    if not how.labels:
        raise ModelRefused(
            "no labels: give --labels FILE (one per line), or use an export whose metadata "
            "holds its class names"
        )
    if len(set(how.labels)) != len(how.labels):
        raise ModelRefused(f"labels repeat a name: {list(how.labels)}")
    post = _postprocess(facts.outputs, how)
    yolo = how.kind in ("yolov8", "yolov5", "yolox", "nms")
    order = how.color_order or "RGB"
    mean, std = ((0.0,) * 3, (1.0,) * 3) if yolo else IMAGENET
    if order == "BGR":  # per channel, in the order the model takes them
        mean, std = mean[::-1], std[::-1]
    return {
        "name": how.name,
        "version": how.version,
        "file": how.file,
        "sha256": how.sha256,
        "opset": facts.opset,
        "input": {
            "name": image.name,
            "shape": [1, 3, height, width],
            "dtype": "float32",
            "layout": "NCHW",
            "color_order": order,
        },
        "preprocess": {
            "resize": {
                "width": width,
                "height": height,
                "interpolation": "linear" if yolo else "area",
                "mode": "letterbox" if yolo else "stretch",
            },
            "scale": how.scale if how.scale is not None else 1 / 255,
            "mean": list(how.mean or mean),
            "std": list(how.std or std),
        },
        "labels": list(how.labels),
        "postprocess": post,
    }


def _image_input(facts: GraphFacts, how: Authoring) -> Tensor:
    if len(facts.inputs) != 1:
        names = ", ".join(f"{t.name} {t.spelt()}" for t in facts.inputs) or "none"
        raise ModelRefused(
            f"the graph takes {len(facts.inputs)} inputs ({names}); one image input is served"
        )
    image = facts.inputs[0]
    if image.dtype != "float32":
        raise ModelRefused(
            f"input {image.name!r} is {image.dtype}; a float32 image tensor is served"
        )
    if len(image.shape) != 4 or image.shape[1] not in (3, None):
        raise ModelRefused(
            f"input {image.name!r} has shape {image.spelt()}; expected an NCHW colour image "
            "[N, 3, H, W]"
        )
    if image.shape[0] not in (None, 1):
        raise ModelRefused(
            f"input {image.name!r} has a fixed batch of {image.shape[0]}; export it with a "
            "batch of 1 or a dynamic one"
        )
    return image


def _size(image: Tensor, how: Authoring) -> tuple[int, int]:
    height, width = image.shape[2], image.shape[3]
    if width is None or height is None:
        if how.size is None:
            raise ModelRefused(
                f"input {image.name!r} has shape {image.spelt()}: its size is left open; give "
                "--size WIDTHxHEIGHT, the size it was trained at"
            )
        return how.size
    if how.size is not None and how.size != (width, height):
        raise ModelRefused(
            f"input {image.name!r} is {width}x{height}; --size says {how.size[0]}x{how.size[1]}"
        )
    return width, height


def _postprocess(outputs: tuple[Tensor, ...], how: Authoring) -> dict[str, Any]:
    n = len(how.labels)
    if how.kind == "classification":
        scores = _one(outputs, how.kind)
        _want(scores, 2, {1: n}, f"[N, {n}] (one score per label)", how)
        return {"kind": "classification", "output": scores.name, "softmax": False}
    if how.kind == "anomaly":
        if n != 2:
            raise ModelRefused(
                f"an anomaly model has two labels, normal then anomalous (e.g. good, "
                f"anomalous); got {n}: {', '.join(how.labels)}"
            )
        return _anomaly(outputs)
    out = _one(outputs, how.kind)
    if how.kind == "yolov8":
        _want(out, 3, {1: 4 + n}, f"[N, {4 + n}, A] (4 box rows, then {n} class scores)", how)
    elif how.kind == "nms":
        _want(out, 3, {2: 6}, "[N, K, 6] (x1 y1 x2 y2, score, label)", how)
    else:
        spelt = f"[N, A, {5 + n}] (4 box columns, objectness, {n} class scores)"
        _want(out, 3, {2: 5 + n}, spelt, how)
    return {
        "kind": "detection",
        "layout": how.kind,
        "outputs": [out.name],
        "score_threshold": 0.25 if how.score_threshold is None else how.score_threshold,
    }


def _anomaly(outputs: tuple[Tensor, ...]) -> dict[str, Any]:
    maps = [t for t in outputs if len(t.shape) == 4 and t.shape[1] in (1, None)]
    maps += [t for t in outputs if len(t.shape) == 3]
    if not maps:
        spelt = ", ".join(f"{t.name} {t.spelt()}" for t in outputs)
        raise ModelRefused(
            f"no output is an anomaly map [N, 1, H, W] or [N, H, W]; the graph has {spelt}"
        )
    scores = [t for t in outputs if len(t.shape) in (1, 2) and t.shape[-1] in (1, None)]
    post: dict[str, Any] = {"kind": "anomaly", "map_output": maps[0].name}
    if scores:
        post["score_output"] = scores[0].name
    return post


def _one(outputs: tuple[Tensor, ...], kind: str) -> Tensor:
    if len(outputs) != 1:
        spelt = ", ".join(f"{t.name} {t.spelt()}" for t in outputs)
        raise ModelRefused(f"a {kind} graph has one output; this one has {len(outputs)}: {spelt}")
    return outputs[0]


def _want(tensor: Tensor, rank: int, fixed: dict[int, int], spelt: str, how: Authoring) -> None:
    if len(tensor.shape) != rank:
        raise ModelRefused(
            f"output {tensor.name!r} has shape {tensor.spelt()}; a {how.kind} graph has {spelt}"
        )
    for axis, size in fixed.items():
        got = tensor.shape[axis]
        if got != size:
            why = "left open" if got is None else f"{got}"
            raise ModelRefused(
                f"output {tensor.name!r} has shape {tensor.spelt()} (axis {axis}: {why}); a "
                f"{how.kind} graph of {len(how.labels)} labels has {spelt}: check --kind and "
                "--labels"
            )
