"""Service-time priors: what each model costs on this node, measured before it serves.

``sluicegate models bench`` times every model the node serves on every backend it has —
the whole path of one image (decode, preprocess, run, postprocess) and one run of its
largest batch — and writes the figures to ``service-times.priors`` (JSON) beside the
models. An edge agent or a pool worker that finds the file starts its service-time averages
from them (and so reports them in its first telemetry), so the broker's placements are
calibrated from the first job instead of learned from nothing. A prior counts only for the
very file it was measured on (its sha256) and the backend the node serves it with.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sluicegate.errors import ConfigError
from sluicegate.files import write_atomic
from sluicegate.vision import label_synth, synth
from sluicegate.vision.openvino_session import backend_of
from sluicegate.vision.runtime import LoadedModel, ModelRegistry, OcrModel

__all__ = ["PRIORS_FILE", "Prior", "Priors", "measure", "priors_for", "read_priors", "write_priors"]

PRIORS_FILE = "service-times.priors"


class Prior(BaseModel):
    """One model on one backend, as measured on this node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    backend: str  # e.g. onnxruntime/CPUExecutionProvider, openvino/CPU
    image_ms: float = Field(gt=0)  # one image, decode to postprocess (p50)
    batch: int = Field(ge=1)
    batch_ms: float = Field(gt=0)  # one run of ``batch`` images (p50)
    runs: int = Field(ge=1)
    measured_at: float


class Priors(BaseModel):
    model_config = ConfigDict(extra="forbid")

    v: int = 1
    priors: list[Prior]


def _sample(model: LoadedModel) -> bytes:
    rng = np.random.default_rng(0)
    if isinstance(model, OcrModel):
        return synth.encode_jpeg(label_synth.generate_label(rng).image)
    width = max(64, model.manifest.input.width * 2)
    height = max(64, model.manifest.input.height * 2)
    return synth.encode_jpeg(synth.generate(rng, width=width, height=height)[0])


def measure(
    registry: ModelRegistry, *, batch: int = 8, runs: int = 30, now: float | None = None
) -> list[Prior]:
    """Time every model of ``registry`` (after a warm-up of three runs)."""
    out = []
    for name in registry.names():
        model = registry.get(name)
        data = _sample(model)
        for _ in range(3):
            model.infer_bytes(data)
        image = []
        for _ in range(runs):
            t0 = time.perf_counter()
            model.infer_bytes(data)
            image.append((time.perf_counter() - t0) * 1e3)
        size = batch if model.batchable else 1
        tensor, _d, _p, frame = model.prepare(data)
        many = np.concatenate([tensor] * size)
        frames = [frame] * size
        batched = []
        for _ in range(max(3, runs // size)):
            t0 = time.perf_counter()
            model.run(many, frames)
            batched.append((time.perf_counter() - t0) * 1e3)
        out.append(
            Prior(
                model=name,
                sha256=model.manifest.sha256,
                backend=backend_of(model.session.get_providers()[0]),
                image_ms=round(statistics.median(image), 4),
                batch=size,
                batch_ms=round(statistics.median(batched), 4),
                runs=runs,
                measured_at=now if now is not None else time.time(),
            )
        )
    return out


def write_priors(path: Path, priors: Sequence[Prior]) -> None:
    """Write ``priors``, keeping those already in the file for other models or backends."""
    kept = [p for p in read_priors(path) if not any(_same(p, q) for q in priors)]
    doc = Priors(priors=[*kept, *priors])
    write_atomic(path, (json.dumps(doc.model_dump(), indent=1) + "\n").encode())


def read_priors(path: Path) -> list[Prior]:
    """The priors in ``path`` (none when there is no file); a file that cannot be read as
    priors is a ConfigError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"service-time priors {path} cannot be read: {exc.strerror}") from exc
    try:
        return Priors.model_validate_json(text).priors
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(
            f"service-time priors {path} are not valid ({where}: {first['msg']}); run "
            "'sluicegate models bench' again to rewrite them"
        ) from exc


def priors_for(registry: ModelRegistry, priors: Sequence[Prior]) -> dict[str, Prior]:
    """The priors that fit what ``registry`` serves: the same file, the same backend."""
    fit: dict[str, Prior] = {}
    for prior in priors:
        if prior.model not in registry:
            continue
        model = registry.get(prior.model)
        backend = backend_of(model.session.get_providers()[0])
        if prior.sha256 == model.manifest.sha256 and prior.backend == backend:
            fit[prior.model] = prior
    return fit


def _same(a: Prior, b: Prior) -> bool:
    return (a.model, a.backend) == (b.model, b.backend)
