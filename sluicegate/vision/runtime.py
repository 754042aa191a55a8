"""Loaded, verified ONNX models and the one code path from image bytes to labelled outputs.

``ModelRegistry.from_dir`` loads every manifest in a folder and refuses any model file whose
sha256 differs from its manifest: the bytes that were hashed are the bytes handed to ONNX
Runtime, so nothing can swap the file in between. ``LoadedModel.infer_bytes`` is the path
both the edge agent and the model build use (decode, preprocess, run, postprocess), so what
was measured at build time is what runs in production.

Parallelism is the caller's job (one job per executor thread); this module keeps OpenCV and
ONNX Runtime to one thread each by default so concurrent jobs do not oversubscribe cores.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from sluicegate.errors import ModelError, ModelIntegrityError, OutputError, UnknownModelError
from sluicegate.vision.geometry import Frame
from sluicegate.vision.image import ImageInfo, check_dimensions, dct_reduction, decode, probe
from sluicegate.vision.manifest import (
    ModelManifest,
    OcrPostprocess,
    load_manifest,
    verified_file,
    verified_model,
)
from sluicegate.vision.ocr_model import charset_of, prepare_image, read_text
from sluicegate.vision.openvino_session import OPENVINO, OpenVinoSession, openvino_devices
from sluicegate.vision.postprocess import Outputs, postprocess
from sluicegate.vision.preprocess import frame_of, preprocess

__all__ = ["LoadedModel", "ModelRegistry", "OcrModel", "StageTimes", "default_models_dir"]

cv2.setNumThreads(1)

MODELS_DIR_ENV = "SLUICEGATE_MODELS_DIR"


@dataclass(frozen=True)
class StageTimes:
    decode_ms: float
    preprocess_ms: float
    inference_ms: float  # session.run plus postprocess

    @property
    def total_ms(self) -> float:
        return self.decode_ms + self.preprocess_ms + self.inference_ms


class LoadedModel:
    """A verified model: its manifest and an ONNX Runtime session (safe to share across
    threads). A graph whose batch dimension is fixed (a third-party export with batch 1)
    is not batchable: a batch handed to :meth:`run` is run that many images at a time."""

    batchable = True  # images of one batch share the input size

    def __init__(self, manifest: ModelManifest, session: Any) -> None:
        self.manifest = manifest
        self.session = session
        self._input_name = manifest.input.name
        self._output_names = manifest.output_names
        self.fixed_batch = fixed_batch(session, self._input_name)
        if self.fixed_batch is not None:
            self.batchable = False

    def __repr__(self) -> str:
        return f"LoadedModel({self.manifest.name!r}, version={self.manifest.version!r})"

    def run(
        self, batch: npt.NDArray[np.float32], frames: Sequence[Frame] | None = None
    ) -> list[Outputs]:
        """Run a float32 NCHW batch (any batch size) and read one Outputs per item, each
        mapped back to its image through its frame (see :meth:`prepare`)."""
        step = self.fixed_batch
        if step is not None and len(batch) > step:
            return [
                out
                for at in range(0, len(batch), step)
                for out in self.run(
                    batch[at : at + step], None if frames is None else frames[at : at + step]
                )
            ]
        raw = self.session.run(self._output_names, {self._input_name: batch})
        return self.stamped(postprocess(list(raw), self.manifest, frames))

    def stamped(self, outputs: list[Outputs]) -> list[Outputs]:
        """The outputs, each saying which build of the model answered."""
        version, sha256 = self.manifest.version, self.manifest.sha256
        return [replace(o, version=version, sha256=sha256) for o in outputs]

    def prepare(
        self,
        data: bytes,
        *,
        info: ImageInfo | None = None,
        max_pixels: int | None = None,
        max_side: int | None = None,
    ) -> tuple[npt.NDArray[np.float32], float, float, Frame]:
        """Bytes to input tensor: ``(batch of one, decode_ms, preprocess_ms, frame)``, the
        frame saying where the image sits in the input (for mapping results back).

        The header is probed first (cheap; pass ``info`` when the caller already probed);
        with limits given, an oversized image is refused before decoding. The header also
        tells whether the JPEG decoder may shrink the image for free.
        """
        t0 = time.perf_counter()
        if info is None:
            info = probe(data)
        if max_pixels is not None or max_side is not None:
            check_dimensions(
                info,
                max_pixels=max_pixels if max_pixels is not None else info.pixels,
                max_side=max_side if max_side is not None else max(info.width, info.height),
            )
        spec = self.manifest.preprocess
        reduce = 1
        if spec.jpeg_dct_scaling:
            reduce = dct_reduction(info, spec.resize.width, spec.resize.height)
        img = decode(data, reduce=reduce)
        t1 = time.perf_counter()
        batch = preprocess(img, self.manifest)
        t2 = time.perf_counter()
        return batch, (t1 - t0) * 1e3, (t2 - t1) * 1e3, frame_of(img, spec.resize)

    def infer_bytes(
        self,
        data: bytes,
        *,
        info: ImageInfo | None = None,
        max_pixels: int | None = None,
        max_side: int | None = None,
    ) -> tuple[Outputs, StageTimes]:
        """Decode, preprocess, run and postprocess one encoded image, timing each stage."""
        batch, decode_ms, preprocess_ms, frame = self.prepare(
            data, info=info, max_pixels=max_pixels, max_side=max_side
        )
        t0 = time.perf_counter()
        (outputs,) = self.run(batch, (frame,))
        inference_ms = (time.perf_counter() - t0) * 1e3
        return outputs, StageTimes(decode_ms, preprocess_ms, inference_ms)


def fixed_batch(session: Any, input_name: str) -> int | None:
    """The batch size the graph's input ``input_name`` is fixed at, or None when its batch
    dimension is dynamic (or the session cannot say)."""
    try:
        inputs = session.get_inputs()
    except AttributeError:
        return None
    for arg in inputs:
        if arg.name == input_name and arg.shape:
            first = arg.shape[0]
            return first if isinstance(first, int) and first > 0 else None
    return None


class OcrModel(LoadedModel):
    """Text detection and recognition under one name (:mod:`sluicegate.vision.ocr_model`):
    one image per run, since each is detected at its own size."""

    batchable = False

    def __init__(
        self, manifest: ModelManifest, detector: Any, recogniser: Any, charset: tuple[str, ...]
    ) -> None:
        super().__init__(manifest, detector)
        self.recogniser = recogniser
        self.charset = charset

    def prepare(
        self,
        data: bytes,
        *,
        info: ImageInfo | None = None,
        max_pixels: int | None = None,
        max_side: int | None = None,
    ) -> tuple[npt.NDArray[np.float32], float, float, Frame]:
        return prepare_image(
            self.manifest, data, info=info, max_pixels=max_pixels, max_side=max_side
        )

    def run(
        self, batch: npt.NDArray[np.float32], frames: Sequence[Frame] | None = None
    ) -> list[Outputs]:
        if frames is None:
            raise OutputError("an OCR model reads crops of the image: pass the frames")
        return self.stamped(
            read_text(self.manifest, self.session, self.recogniser, self.charset, batch, frames)
        )


class ModelRegistry:
    """The models one node serves, by name."""

    def __init__(self, models: dict[str, LoadedModel]) -> None:
        self._models = dict(models)

    @classmethod
    def from_dir(
        cls,
        path: Path,
        *,
        providers: list[str] | None = None,
        intra_op_threads: int = 1,
        known: ModelRegistry | None = None,
    ) -> ModelRegistry:
        """Load and verify every ``*.json`` manifest in ``path`` and the model it names; a
        model ``known`` already holds with the same manifest is taken from it as it is
        (after its files' sha256 are checked again), not loaded a second time."""
        path = Path(path)
        if not path.is_dir():
            raise ModelIntegrityError(
                f"models folder {path} does not exist; set {MODELS_DIR_ENV} to the folder "
                "that holds the model manifests (*.json) and files (*.onnx)"
            )
        manifests = sorted(path.glob("*.json"))
        if not manifests:
            raise ModelIntegrityError(f"no model manifests (*.json) in {path}")
        chosen = _providers(providers)
        models: dict[str, LoadedModel] = {}
        sources: dict[str, Path] = {}
        for manifest_path in manifests:
            manifest = load_manifest(manifest_path)
            if manifest.name in models:
                raise ModelIntegrityError(
                    f"model name {manifest.name!r} is declared by both "
                    f"{sources[manifest.name]} and {manifest_path}"
                )
            sources[manifest.name] = manifest_path
            held = known._models.get(manifest.name) if known is not None else None
            if held is not None and held.manifest == manifest:
                for file, sha256 in manifest.files:
                    verified_file(path, manifest_path, file, sha256)
                models[manifest.name] = held
                continue
            session = _open_verified(path, manifest_path, manifest, chosen, intra_op_threads)
            models[manifest.name] = _served(
                path, manifest_path, manifest, session, chosen, intra_op_threads
            )
        return cls(models)

    def take(self, newer: ModelRegistry) -> list[str]:
        """Serve ``newer``'s models from now on: each later :meth:`get` finds them, while a
        job already running keeps the model object it got. Returns what changed, in words."""
        changed = []
        for name in sorted(set(self._models) | set(newer._models)):
            old, new = self._models.get(name), newer._models.get(name)
            if old is new:
                continue
            if new is None:
                changed.append(f"{name} removed")
            elif old is None:
                changed.append(f"{name} {new.manifest.version} added")
            else:
                changed.append(f"{name} {old.manifest.version} -> {new.manifest.version}")
        self._models = dict(newer._models)
        return changed

    def names(self) -> list[str]:
        return sorted(self._models)

    def get(self, name: str) -> LoadedModel:
        try:
            return self._models[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise UnknownModelError(f"unknown model {name!r}; known: {known}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._models)


def default_models_dir() -> Path:
    """``$SLUICEGATE_MODELS_DIR`` if set, else the repository's ``models/`` folder when
    running from a checkout, else ``<sys.prefix>/share/sluicegate/models``: an installed
    wheel has no repository beside it, and the offline bundle's ``install.sh`` links its
    models there (docs/deployment.md)."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        return Path(override).expanduser()
    checkout = Path(__file__).resolve().parents[2] / "models"
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "sluicegate" / "models"


def session_options(intra_op_threads: int = 1) -> Any:
    """ONNX Runtime options for one job at a time per session call, on a fixed thread budget."""
    if intra_op_threads < 1:
        raise ValueError(f"intra_op_threads must be at least 1, got {intra_op_threads}")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    return opts


def _providers(requested: list[str] | None) -> list[str]:
    if requested is None:
        return ["CPUExecutionProvider"]
    available = list(ort.get_available_providers())
    if any(p.startswith(OPENVINO) for p in requested):
        available += [OPENVINO + d for d in openvino_devices()]
    missing = [p for p in requested if p not in available]
    if missing or not requested:
        raise ModelError(
            f"execution provider(s) {', '.join(missing) or '(none given)'} not available "
            f"in this onnxruntime; available: {', '.join(available)}"
        )
    return list(requested)


def _served(
    folder: Path,
    manifest_path: Path,
    manifest: ModelManifest,
    session: Any,
    providers: list[str],
    intra_op_threads: int,
) -> LoadedModel:
    post = manifest.postprocess
    if not isinstance(post, OcrPostprocess):
        return LoadedModel(manifest, session)
    rec = post.recognizer
    blob = verified_file(folder, manifest_path, rec.file, rec.sha256)
    where = f"{folder / rec.file}"
    recogniser = _session(blob, where, providers, intra_op_threads)
    charset = charset_of(recogniser, where)
    outputs = {o.name: o.shape for o in recogniser.get_outputs()}
    classes = outputs.get(rec.output, [None])[-1]
    if rec.output not in outputs or classes != len(charset) + 1:
        raise ModelIntegrityError(
            f"{where}: recogniser output {rec.output!r} must be [N, T, {len(charset) + 1}] "
            f"(blank + its {len(charset)} characters); the graph has {outputs}"
        )
    return OcrModel(manifest, session, recogniser, charset)


def _session(blob: bytes, where: str, providers: list[str], intra_op_threads: int) -> Any:
    """A session on the first provider's backend: OpenVINO for ``OpenVINO/<device>``, else
    ONNX Runtime with the ONNX Runtime providers listed."""
    if providers[0].startswith(OPENVINO):
        device = providers[0].removeprefix(OPENVINO)
        try:
            return OpenVinoSession(blob, device=device, threads=intra_op_threads)
        except ModelIntegrityError:
            raise
        except Exception as exc:  # OpenVINO raises its own untyped errors
            raise ModelIntegrityError(f"OpenVINO cannot load {where}: {exc}") from exc
    native = [p for p in providers if not p.startswith(OPENVINO)]
    try:
        return ort.InferenceSession(
            blob, sess_options=session_options(intra_op_threads), providers=native
        )
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise ModelIntegrityError(f"ONNX Runtime cannot load {where}: {exc}") from exc


def _open_verified(
    folder: Path,
    manifest_path: Path,
    manifest: ModelManifest,
    providers: list[str],
    intra_op_threads: int,
) -> Any:
    model_path = folder / manifest.file
    blob = verified_model(folder, manifest_path, manifest)
    session = _session(blob, str(model_path), providers, intra_op_threads)
    _check_signature(session, manifest, model_path)
    return session


def _check_signature(session: Any, manifest: ModelManifest, model_path: Path) -> None:
    """The graph's input and outputs must be the ones the manifest describes."""
    inputs = {i.name: i for i in session.get_inputs()}
    spec = manifest.input
    if spec.name not in inputs:
        raise ModelIntegrityError(
            f"{model_path}: manifest input {spec.name!r} is not a graph input; "
            f"graph inputs: {', '.join(inputs)}"
        )
    shape = list(inputs[spec.name].shape)
    # Symbolic (dynamic) dimensions are strings or None; only fixed ones must agree.
    if len(shape) != 4 or any(
        isinstance(got, int) and got != want
        for got, want in zip(shape[1:], spec.shape[1:], strict=True)
    ):
        raise ModelIntegrityError(
            f"{model_path}: graph input {spec.name!r} has shape {shape}; "
            f"manifest says {list(spec.shape)}"
        )
    outputs = {o.name for o in session.get_outputs()}
    missing = [name for name in manifest.output_names if name not in outputs]
    if missing:
        raise ModelIntegrityError(
            f"{model_path}: manifest output(s) {', '.join(missing)} not in the graph; "
            f"graph outputs: {', '.join(sorted(outputs))}"
        )
