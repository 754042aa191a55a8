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
    "ClassificationPostprocess",
    "DetectionPostprocess",
    "InputSpec",
    "ModelManifest",
    "PreprocessSpec",
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
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    interpolation: Interpolation = "area"


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


class DetectionPostprocess(_Strict):
    """Boxes ``[N, K, 4]`` and per-label scores ``[N, K, C]``, then per-label NMS.

    Box coordinates are in model-input pixels unless ``normalized``; results are always
    reported normalised to ``[0, 1]`` of the image, which survives the resize.
    """

    kind: Literal["detection"]
    boxes_output: str = Field(min_length=1)
    scores_output: str = Field(min_length=1)
    box_format: Literal["xyxy", "cxcywh"] = "xyxy"
    normalized: bool = False
    score_threshold: float = Field(default=0.25, ge=0.0, le=1.0)
    iou_threshold: float = Field(default=0.45, gt=0.0, le=1.0)
    max_detections: int = Field(default=100, gt=0)


Postprocess = Annotated[
    ClassificationPostprocess | DetectionPostprocess, Field(discriminator="kind")
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
    file: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*\.onnx$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    opset: int = Field(ge=17)
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
        return self

    @property
    def output_names(self) -> list[str]:
        """The graph outputs postprocessing reads, in the order it expects them."""
        post = self.postprocess
        if isinstance(post, ClassificationPostprocess):
            return [post.output]
        return [post.boxes_output, post.scores_output]


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
        problems = "; ".join(_describe(err) for err in exc.errors(include_url=False))
        raise ModelIntegrityError(f"invalid model manifest {path}: {problems}") from exc


def verified_model(folder: Path, manifest_path: Path, manifest: ModelManifest) -> bytes:
    """The bytes of the model file ``manifest`` names in ``folder``, once their sha256 is the
    manifest's; ModelIntegrityError naming both files otherwise."""
    model_path = folder / manifest.file
    try:
        blob = model_path.read_bytes()
    except OSError as exc:
        raise ModelIntegrityError(
            f"model file {model_path} named by {manifest_path} cannot be read: {exc.strerror}"
        ) from exc
    actual = hashlib.sha256(blob).hexdigest()
    if actual != manifest.sha256:
        raise ModelIntegrityError(
            f"model file {model_path} does not match its manifest {manifest_path}: "
            f"expected sha256 {manifest.sha256}, actual {actual}"
        )
    return blob


def _describe(err: ErrorDetails) -> str:
    where = ".".join(str(part) for part in err["loc"]) or "manifest"
    if err["type"] == "missing":
        return f"{where}: missing"
    got = err.get("input")
    if isinstance(got, str | int | float | bool):
        return f"{where}: {err['msg']} (got {got!r})"
    return f"{where}: {err['msg']}"
