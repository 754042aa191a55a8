"""``sluicegate models add``: a model someone brings, checked and installed in a models
folder with the manifest written for it.

The graph is read (:mod:`sluicegate.vision.graph`) and judged against the kind it is said to
be (:mod:`sluicegate.vision.author`); the manifest it gets carries the file's sha256. Before
anything lands in the folder, the model is loaded the way every node loads it (verified
against that manifest, by ONNX Runtime) and run once on a sample image, so a model that
does not load, or whose answer cannot be read, is refused with the reason and leaves the
folder as it was. Then the file and its manifest are written atomically.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from sluicegate.errors import ModelError, ModelIntegrityError
from sluicegate.files import write_atomic
from sluicegate.vision import synth
from sluicegate.vision.author import Authoring, ModelRefused, manifest_for
from sluicegate.vision.graph import labels_in_metadata, read_graph
from sluicegate.vision.manifest import ModelManifest, problems
from sluicegate.vision.postprocess import Outputs
from sluicegate.vision.runtime import ModelRegistry

__all__ = ["Added", "add_model", "read_labels"]


@dataclass(frozen=True)
class Added:
    manifest: ModelManifest
    manifest_path: Path
    outputs: Outputs  # its answer to the sample image
    run_ms: float  # decode, preprocess, inference and postprocess of the sample


def read_labels(path: Path) -> tuple[str, ...]:
    """One label per line; blank lines and lines starting with ``#`` are skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ModelRefused(f"labels file {path} cannot be read: {exc.strerror}") from exc
    return tuple(s for line in lines if (s := line.strip()) and not s.startswith("#"))


def add_model(
    source: Path,
    models_dir: Path,
    how: Authoring,
    *,
    sample: bytes | None = None,
    replace_existing: bool = False,
) -> Added:
    """Check ``source`` as ``how`` describes it, run it once on ``sample`` (a synthetic
    surface when None) and install it as ``models_dir/<name>.onnx`` with its manifest."""
    try:
        blob = source.read_bytes()
    except OSError as exc:
        raise ModelRefused(f"model file {source} cannot be read: {exc.strerror}") from exc
    facts = read_graph(source)
    if not how.labels:
        how = replace(how, labels=labels_in_metadata(facts.metadata) or ())
    how = replace(how, file=f"{how.name}.onnx", sha256=hashlib.sha256(blob).hexdigest())
    document = manifest_for(facts, how)
    try:
        manifest = ModelManifest.model_validate(document)
    except ValidationError as exc:
        raise ModelRefused(
            f"the manifest written for {source} is not valid: {problems(exc)}"
        ) from exc
    target = models_dir / f"{how.name}.json"
    if target.exists() and not replace_existing:
        raise ModelRefused(
            f"{target} exists already; give another --name, or --replace to serve this file "
            "in its place"
        )
    text = json.dumps(document, indent=2) + "\n"
    with tempfile.TemporaryDirectory(prefix="sg-model-") as scratch:
        folder = Path(scratch)
        (folder / how.file).write_bytes(blob)
        (folder / target.name).write_text(text, encoding="utf-8")
        outputs, run_ms = _try(folder, manifest, sample)
    models_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(models_dir / how.file, blob)
    write_atomic(target, text.encode())
    return Added(manifest, target, outputs, run_ms)


def _try(folder: Path, manifest: ModelManifest, sample: bytes | None) -> tuple[Outputs, float]:
    registry = ModelRegistry.from_dir(folder)
    model = registry.get(manifest.name)
    if sample is None:
        width, height = max(64, manifest.input.width), max(64, manifest.input.height)
        image, _ = synth.generate(np.random.default_rng(0), "scratch", width=width, height=height)
        sample = synth.encode_jpeg(image)
    t0 = time.perf_counter()
    try:
        outputs, _times = model.infer_bytes(sample)
    except ModelError:
        raise
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise ModelIntegrityError(
            f"{manifest.name}: ONNX Runtime could not run the sample image: {exc}"
        ) from exc
    return outputs, (time.perf_counter() - t0) * 1e3
