"""What a model's ONNX graph declares, read without running it: its one image input, its
outputs with their shapes (a dimension the exporter left open is None), the operator set,
and the metadata an exporter wrote (Ultralytics keeps the class names under ``names``).

Reading the graph needs the ``onnx`` package (``pip install 'sluicegate[tools]'``); serving
a model never does. :func:`read_graph` is the only function here that touches ``onnx``.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluicegate.errors import ModelIntegrityError

__all__ = ["GraphFacts", "Tensor", "labels_in_metadata", "read_graph"]

Dim = int | None


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[Dim, ...]
    dtype: str  # "float32", "int64", ...

    def spelt(self) -> str:
        return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"


@dataclass(frozen=True)
class GraphFacts:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    opset: int  # of the default ("ai.onnx") domain
    metadata: dict[str, str]


def read_graph(path: Path) -> GraphFacts:
    """The facts of the ONNX file at ``path``; ModelIntegrityError if it is not one."""
    try:
        import onnx
    except ImportError as exc:  # pragma: no cover - the tools extra is part of dev
        raise ModelIntegrityError(
            "reading a model's graph needs the onnx package: pip install 'sluicegate[tools]'"
        ) from exc
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (OSError, ValueError) as exc:
        raise ModelIntegrityError(f"{path} cannot be read: {exc}") from exc
    except Exception as exc:  # onnx raises protobuf's own DecodeError for a file of another kind
        raise ModelIntegrityError(f"{path} is not an ONNX model: {exc}") from exc
    graph = model.graph
    initialised = {init.name for init in graph.initializer}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return GraphFacts(
        inputs=tuple(_tensor(v, onnx) for v in graph.input if v.name not in initialised),
        outputs=tuple(_tensor(v, onnx) for v in graph.output),
        opset=int(opset),
        metadata={p.key: p.value for p in model.metadata_props},
    )


# Where exporters keep class names: Ultralytics ``names``, others ``classes``, ``labels``
# or ``class_names``, first found wins.
LABEL_KEYS = ("names", "classes", "labels", "class_names")


def labels_in_metadata(metadata: dict[str, str]) -> tuple[str, ...] | None:
    """Class names an exporter stored: ``{0: 'scratch', ...}`` (Ultralytics), a list as
    Python or JSON (``["ok", "ng"]``), or plain comma-separated text (``ok, ng``)."""
    for key in LABEL_KEYS:
        text = metadata.get(key, "").strip()
        if text:
            return _names(text)
    return None


def _names(text: str) -> tuple[str, ...] | None:
    try:
        names = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        try:
            names = json.loads(text)
        except ValueError:
            names = [n.strip() for n in text.split(",")] if "," in text else None
    if isinstance(names, dict) and all(isinstance(k, int | str) for k in names):
        try:
            order = sorted(names, key=int)
        except ValueError:
            return None
        return tuple(str(names[k]) for k in order)
    if isinstance(names, list | tuple) and all(str(n).strip() for n in names):
        return tuple(str(n) for n in names)
    return None


def _tensor(value: Any, onnx: Any) -> Tensor:
    kind = value.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type).name if kind.elem_type else "?"
    shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in kind.shape.dim)
    return Tensor(value.name, shape, dtype)
