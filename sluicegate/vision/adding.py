"""``sluicegate models add``: a model someone brings, checked and installed in a models
folder with the manifest written for it.

The graph is read (:mod:`sluicegate.vision.graph`) and judged against the kind it is said to
be (:mod:`sluicegate.vision.author`); the manifest it gets carries the file's sha256. Before
anything lands in the folder, the model is loaded the way every node loads it (verified
against that manifest, by ONNX Runtime) and run once on a sample image, so a model that
does not load, or whose answer cannot be read, is refused with the reason and leaves the
folder as it was. Then the file and its manifest are written atomically.

With ``replace_existing`` a new version takes the place of a model of that name and keeps
what its manifest was given that the graph does not say (often edited by hand for a
third-party model): the preprocessing (scale, mean, std, resize mode, interpolation, pad,
JPEG DCT scaling), the colour order and the score threshold, unless given again; the labels
come from ``--labels``, else the new export's metadata, else the replaced manifest.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

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
    kept: tuple[str, ...] = ()  # what it kept from the manifest it replaced


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
    target = models_dir / f"{how.name}.json"
    if target.exists() and not replace_existing:
        raise ModelRefused(
            f"{target} exists already; give another --name, or --replace to serve this file "
            "in its place"
        )
    old = _replaced(target) if replace_existing else None
    if not how.labels:
        labels = labels_in_metadata(facts.metadata) or (tuple(old["labels"]) if old else ())
        how = replace(how, labels=labels)
    how = replace(how, file=f"{how.name}.onnx", sha256=hashlib.sha256(blob).hexdigest())
    document = manifest_for(facts, how)
    kept = _keep(document, old, how) if old is not None else ()
    try:
        manifest = ModelManifest.model_validate(document)
    except ValidationError as exc:
        raise ModelRefused(
            f"the manifest written for {source} is not valid: {problems(exc)}"
        ) from exc
    text = json.dumps(document, indent=2) + "\n"
    with tempfile.TemporaryDirectory(prefix="sg-model-") as scratch:
        folder = Path(scratch)
        (folder / how.file).write_bytes(blob)
        (folder / target.name).write_text(text, encoding="utf-8")
        outputs, run_ms = _try(folder, manifest, sample)
    models_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(models_dir / how.file, blob)
    write_atomic(target, text.encode())
    return Added(manifest, target, outputs, run_ms, kept)


def _replaced(target: Path) -> dict[str, Any] | None:
    """The manifest a replacement takes the place of, as written (None: there is none)."""
    try:
        doc = json.loads(target.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ModelRefused(f"{target} cannot be read to replace it: {exc}") from exc
    return doc if isinstance(doc, dict) else None


def _keep(document: dict[str, Any], old: dict[str, Any], how: Authoring) -> tuple[str, ...]:
    """Carry into ``document`` what the replaced manifest ``old`` was given and ``how``
    does not say again; the names of what was kept."""
    kept: list[str] = []

    def carry(into: dict[str, Any], source: dict[str, Any], key: str, name: str) -> None:
        # Only a key the new manifest has (or, for resize, may have: its defaults are left
        # out), so a replacement of another kind takes nothing it could not hold.
        if (
            key in source
            and (key in into or into is pre["resize"])
            and source[key] != into.get(key)
        ):
            into[key] = source[key]
            kept.append(name)

    pre, was = document["preprocess"], old.get("preprocess") or {}
    for key, said in (("scale", how.scale), ("mean", how.mean), ("std", how.std)):
        if said is None:
            carry(pre, was, key, key)
    for key in ("mode", "interpolation", "pad_value"):
        carry(pre["resize"], was.get("resize") or {}, key, key)
    if was.get("jpeg_dct_scaling") and not pre.get("jpeg_dct_scaling"):
        pre["jpeg_dct_scaling"] = True
        kept.append("jpeg_dct_scaling")
    if how.color_order is None:
        carry(document["input"], old.get("input") or {}, "color_order", "color_order")
    if how.score_threshold is None:
        post = document["postprocess"]
        carry(post, old.get("postprocess") or {}, "score_threshold", "score_threshold")
    return tuple(kept)


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
