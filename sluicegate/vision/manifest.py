"""The model manifest: everything the runtime must know to feed a model and read its answer.

A manifest (``models/<name>.json``) sits beside its ``.onnx`` file and is the only place
where input size, colour order, normalisation, labels and postprocessing are written down;
the build script, the edge agent and the pool workers all read them from here, so training
and serving cannot drift apart. This module validates manifests and checks a model file's
bytes against its manifest's sha256 (:func:`verified_model`); it never loads the model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from sluicegate.errors import ModelIntegrityError

__all__ = [
    "AnomalyPostprocess",
    "ClassificationPostprocess",
    "DetectionPostprocess",
    "InputSpec",
    "ModelManifest",
    "OcrPostprocess",
    "PreprocessSpec",
    "RecognizerSpec",
    "ResizeSpec",
    "load_manifest",
]

Interpolation = Literal["area", "linear", "cubic", "nearest"]
Positive = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputSpec(_Strict):
    """The model's single image input tensor."""

    name: str = Field(min_length=1)
    # [batch, channels, height, width]; the batch dimension of the graph itself is dynamic.
    shape: tuple[Literal[1], Literal[3], PositiveInt, PositiveInt]
    dtype: Literal["float32"] = "float32"
    layout: Literal["NCHW"] = "NCHW"
    color_order: Literal["RGB", "BGR"]

    @property
    def height(self) -> int:
        return self.shape[2]

    @property
    def width(self) -> int:
        return self.shape[3]


class ResizeSpec(_Strict):
    """``stretch`` scales the image to width x height; ``letterbox`` (what YOLO exporters
    expect) scales it to fit, keeping its aspect ratio, and pads the rest, centred, with
    ``pad_value``. Results are mapped back to the original image either way."""

    width: int = Field(gt=0)
    height: int = Field(gt=0)
    interpolation: Interpolation = "area"
    mode: Literal["stretch", "letterbox"] = "stretch"
    pad_value: int = Field(default=114, ge=0, le=255)


class PreprocessSpec(_Strict):
    """``(pixel * scale - mean) / std`` per channel, in the input's colour order."""

    resize: ResizeSpec
    scale: float = Field(gt=0)
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[Positive, Positive, Positive] = (1.0, 1.0, 1.0)
    # JPEGs may be decoded at 1/2, 1/4 or 1/8 size by DCT scaling (libjpeg), never below
    # the resize target; that is an area-like shrink done for free inside the decoder.
    jpeg_dct_scaling: bool = False


class ClassificationPostprocess(_Strict):
    """One score per label; ``softmax`` when the graph outputs logits."""

    kind: Literal["classification"]
    output: str = Field(min_length=1)
    softmax: bool = False


DetectionLayout = Literal["boxes_scores", "yolov8", "yolov5", "yolox", "nms"]


class DetectionPostprocess(_Strict):
    """Candidate boxes and per-label scores, in the layout the exporter wrote, then per-label
    non-maximum suppression (except ``nms``, whose graph did it).

    ``layout`` (all in model-input pixels unless ``normalized``):

    - ``boxes_scores``: two outputs, boxes ``[N, K, 4]`` (``box_format``) and scores
      ``[N, K, C]`` (``outputs`` = [boxes, scores]);
    - ``yolov8`` (v8, v11): one output ``[N, 4 + C, A]``, cx cy w h then class scores;
    - ``yolov5``: one output ``[N, A, 5 + C]``, cx cy w h, objectness, class scores (a
      label's score is objectness x class score);
    - ``yolox``: one output ``[N, A, 5 + C]`` as the head writes it before decoding: x, y as
      offsets in a grid cell, w, h as logs, for the grids of ``strides`` in order;
    - ``nms``: one output ``[N, K, 6]`` already suppressed in the graph: x1 y1 x2 y2, score,
      label index (rows with score 0 are padding).

    Results are always reported as fractions ``[0, 1]`` of the original image, xyxy.
    """

    kind: Literal["detection"]
    layout: DetectionLayout = "boxes_scores"
    outputs: tuple[str, ...] = Field(default=(), max_length=2)
    # The two outputs of the boxes_scores layout (kept for manifests written before layouts).
    boxes_output: str | None = None
    scores_output: str | None = None
    box_format: Literal["xyxy", "cxcywh"] = "xyxy"
    normalized: bool = False
    strides: tuple[PositiveInt, ...] = (8, 16, 32)
    score_threshold: float = Field(default=0.25, ge=0.0, le=1.0)
    iou_threshold: float = Field(default=0.45, gt=0.0, le=1.0)
    max_detections: int = Field(default=100, gt=0)

    @model_validator(mode="after")
    def _outputs_fit_layout(self) -> DetectionPostprocess:
        names = self.tensor_names
        want = 2 if self.layout == "boxes_scores" else 1
        if len(names) != want or not all(names):
            raise ValueError(
                f"layout {self.layout!r} reads {want} output(s); give outputs = "
                f"{['boxes', 'scores'] if want == 2 else ['output0']} (got {list(names)})"
            )
        return self

    @property
    def tensor_names(self) -> tuple[str, ...]:
        if self.outputs:
            return self.outputs
        return tuple(n for n in (self.boxes_output, self.scores_output) if n is not None)


class AnomalyPostprocess(_Strict):
    """An anomaly-score map ``[N, 1, H, W]`` (or ``[N, H, W]``) and, if the graph has one,
    an image score ``[N]`` / ``[N, 1]`` (else the map's maximum), anomalib-style.

    Pixels scoring at least ``pixel_threshold`` form regions (8-connected); a region smaller
    than ``min_area`` (a fraction of the map) is noise. The image is ``labels[1]``
    (anomalous) when its score is at least ``image_threshold``, else ``labels[0]``.
    """

    kind: Literal["anomaly"]
    map_output: str = Field(min_length=1)
    score_output: str | None = None
    pixel_threshold: float = 0.5
    image_threshold: float = 0.5
    min_area: float = Field(default=0.0005, ge=0.0, lt=1.0)
    max_regions: int = Field(default=50, gt=0)


OnnxFile = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*\.onnx$")]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class RecognizerSpec(_Strict):
    """The second stage of an OCR model: a CTC text recogniser (PP-OCR's), in the same
    folder, verified by its own sha256. Its input is ``[N, 3, height, W]``, W at least
    ``min_width``; its output ``[N, T, 1 + characters]``; its character set is in its
    metadata (``character``)."""

    file: OnnxFile
    sha256: Sha256
    input: str = Field(default="x", min_length=1)
    output: str = Field(min_length=1)
    height: int = Field(default=48, gt=0)
    min_width: int = Field(default=320, gt=0)


class OcrPostprocess(_Strict):
    """Two-stage OCR under one model name: the manifest's own model is the text detector
    (a DB probability map ``[N, 1, H, W]``, ``output``), then each text line it finds is
    cut out and read by the ``recognizer``.

    The detector's input is the image scaled so its longer side is at most the input's
    size and its shorter at least ``min_side``, sides multiples of 32. Map pixels over
    ``threshold`` are text; a box is kept when its mean probability reaches
    ``box_threshold`` and grown by ``unclip_ratio``; a line is reported when its reading's
    confidence reaches ``text_threshold``.
    """

    kind: Literal["ocr"]
    output: str = Field(min_length=1)
    recognizer: RecognizerSpec
    threshold: float = Field(default=0.3, gt=0.0, lt=1.0)
    box_threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    unclip_ratio: float = Field(default=1.6, gt=0.0)
    max_candidates: int = Field(default=1000, gt=0)
    min_side: int = Field(default=320, ge=32)
    text_threshold: float = Field(default=0.5, ge=0.0, le=1.0)


Postprocess = Annotated[
    ClassificationPostprocess | DetectionPostprocess | AnomalyPostprocess | OcrPostprocess,
    Field(discriminator="kind"),
]


class Requirements(_Strict):
    """What a node needs to run the model; the broker places only where these are met."""

    # Any one of these ONNX Runtime execution providers; empty means any provider will do.
    providers: tuple[str, ...] = ()
    # Device (or host) memory the model needs at its largest batch, in MiB.
    memory_mb: int = Field(default=0, ge=0)


class ModelManifest(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")
    version: str = Field(min_length=1)
    # A bare file name in the manifest's own folder: no directories, no way out of it.
    file: OnnxFile
    sha256: Sha256
    opset: int = Field(ge=7)  # the oldest operator set ONNX Runtime still runs
    input: InputSpec
    preprocess: PreprocessSpec
    labels: tuple[str, ...] = Field(min_length=1)
    postprocess: Postprocess
    requirements: Requirements = Requirements()

    @model_validator(mode="after")
    def _consistent(self) -> ModelManifest:
        resize = self.preprocess.resize
        if (resize.height, resize.width) != (self.input.height, self.input.width):
            raise ValueError(
                f"preprocess.resize is {resize.width}x{resize.height} but input.shape "
                f"expects {self.input.width}x{self.input.height}"
            )
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"labels must be unique, got {list(self.labels)}")
        if isinstance(self.postprocess, AnomalyPostprocess) and len(self.labels) != 2:
            raise ValueError(
                f"an anomaly model has two labels, normal then anomalous (e.g. "
                f'["good", "anomalous"]), got {list(self.labels)}'
            )
        return self

    @property
    def files(self) -> tuple[tuple[str, str], ...]:
        """Every model file the manifest names (an OCR model's recogniser too), with the
        sha256 it pins."""
        own = ((self.file, self.sha256),)
        post = self.postprocess
        if isinstance(post, OcrPostprocess):
            return (*own, (post.recognizer.file, post.recognizer.sha256))
        return own

    @property
    def output_names(self) -> list[str]:
        """The graph outputs postprocessing reads, in the order it expects them."""
        post = self.postprocess
        if isinstance(post, ClassificationPostprocess):
            return [post.output]
        if isinstance(post, AnomalyPostprocess):
            return [post.map_output] + ([post.score_output] if post.score_output else [])
        if isinstance(post, OcrPostprocess):
            return [post.output]
        return list(post.tensor_names)


def load_manifest(path: Path) -> ModelManifest:
    """Read and validate one manifest; any problem is a ModelIntegrityError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelIntegrityError(f"cannot read model manifest {path}: {exc.strerror}") from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelIntegrityError(
            f"model manifest {path} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from exc
    try:
        return ModelManifest.model_validate(raw)
    except ValidationError as exc:
        raise ModelIntegrityError(f"invalid model manifest {path}: {problems(exc)}") from exc


def verified_model(folder: Path, manifest_path: Path, manifest: ModelManifest) -> bytes:
    """The bytes of the model file ``manifest`` names in ``folder``, once their sha256 is the
    manifest's; ModelIntegrityError naming both files otherwise."""
    return verified_file(folder, manifest_path, manifest.file, manifest.sha256)


def verified_file(folder: Path, manifest_path: Path, file: str, sha256: str) -> bytes:
    """The bytes of ``folder/file``, once their sha256 is ``sha256`` (as the manifest at
    ``manifest_path`` pins it); ModelIntegrityError naming both files otherwise."""
    model_path = folder / file
    try:
        blob = model_path.read_bytes()
    except OSError as exc:
        raise ModelIntegrityError(
            f"model file {model_path} named by {manifest_path} cannot be read: {exc.strerror}"
        ) from exc
    actual = hashlib.sha256(blob).hexdigest()
    if actual != sha256:
        raise ModelIntegrityError(
            f"model file {model_path} does not match its manifest {manifest_path}: "
            f"expected sha256 {sha256}, actual {actual}"
        )
    return blob


def problems(exc: ValidationError) -> str:
    """A manifest's validation errors, one phrase each, for a person."""
    return "; ".join(_describe(err) for err in exc.errors(include_url=False))


def _describe(err: ErrorDetails) -> str:
    where = ".".join(str(part) for part in err["loc"]) or "manifest"
    if err["type"] == "missing":
        return f"{where}: missing"
    got = err.get("input")
    if isinstance(got, str | int | float | bool):
        return f"{where}: {err['msg']} (got {got!r})"
    return f"{where}: {err['msg']}"
